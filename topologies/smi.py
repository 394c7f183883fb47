"""Parse the matrix that `nvidia-smi topo -m` prints.

Only the device cells are read by position (GPU and NIC columns come first in every row and
never contain blanks); the affinity columns that follow are ignored, because posted outputs
leave them empty (Slurm cgroups) or glue two of them together. Columns are found from the
header, which may be tab- or space-separated, indented or not, and name NICs either NIC#
(with a "NIC Legend" mapping them to devices) or directly mlx5_# (older drivers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from atoll.errors import ConfigError

PCIE_CODES = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC", "PSB")  # SOC/PSB: pre-2018 names
_NV = re.compile(r"^NV(\d+)$")
_GPU = re.compile(r"^GPU(\d+)$")
_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_NOT_DEVICE = ("CPU", "NUMA", "GPU NUMA")


def _is_code(cell: str) -> bool:
    return cell == "X" or cell in PCIE_CODES or bool(_NV.match(cell))


@dataclass(frozen=True)
class SmiMatrix:
    gpus: tuple[str, ...]  # "GPU0", ...
    nics: tuple[str, ...]  # device names: the legend's (mlx5_0) or the column's
    cells: dict = field(repr=False)  # (row label, column label) -> code
    nic_columns: tuple[str, ...] = ()  # the header's labels for the NICs (NIC0 or mlx5_0)
    truncated: bool = False  # the text ended before every NIC cell was read

    def gpu_link(self, a: int, b: int) -> str:
        return self.cells[(f"GPU{a}", f"GPU{b}")]

    def nvlinks(self, a: int, b: int) -> int:
        m = _NV.match(self.gpu_link(a, b))
        return int(m.group(1)) if m else 0

    def islands(self) -> list[list[int]]:
        """GPUs joined by NVLink, directly or through other GPUs (NCCL rings use the hops)."""
        n, seen, out = len(self.gpus), set(), []
        for start in range(n):
            if start in seen:
                continue
            comp, todo = [], [start]
            seen.add(start)
            while todo:
                a = todo.pop()
                comp.append(a)
                for b in range(n):
                    if b not in seen and self.nvlinks(a, b):
                        seen.add(b)
                        todo.append(b)
            out.append(sorted(comp))
        return out

    def near_nics(self, gpu: int) -> list[str]:
        """NICs at most one PCIe bridge from this GPU (PIX): the GPU's own NIC on DGX/HGX boxes."""
        return [self.nics[i] for i, c in enumerate(self.nic_columns)
                if self.cells.get((f"GPU{gpu}", c)) == "PIX"]


def _split(line: str) -> list[str]:
    return [c for c in re.split(r"\t|\s{2,}", line.strip()) if c]


def parse_smi_topo(text: str) -> SmiMatrix:
    """Read `nvidia-smi topo -m` output; raise ConfigError naming what is missing."""
    lines = [ln.rstrip("\n") for ln in text.splitlines() if not ln.startswith("# ")]
    # the header starts with GPU0 (indented or not); the GPU0 row has a code (X) after its label
    header_at = next((i for i, ln in enumerate(lines)
                      if ln.split()[:1] == ["GPU0"] and not _is_code((ln.split() + ["X"])[1])), None)
    if header_at is None:
        raise ConfigError("no `nvidia-smi topo -m` header with GPU0 found in the text")
    columns = []
    for col in _split(lines[header_at]):
        if any(col.startswith(p) for p in _NOT_DEVICE):
            break
        columns.append(col)
    gpu_cols = [c for c in columns if _GPU.match(c)]
    if [int(_GPU.match(c).group(1)) for c in gpu_cols] != list(range(len(gpu_cols))):
        raise ConfigError(f"GPU columns {gpu_cols} are not GPU0..GPU{len(gpu_cols) - 1}")
    nic_cols = [c for c in columns if not _GPU.match(c)]
    cells, truncated, rows = {}, False, {}
    for ln in lines[header_at + 1:]:
        parts = ln.split()
        if parts and parts[0] in columns:
            rows[parts[0]] = parts[1:1 + len(columns)]
    for g in gpu_cols:
        row = rows.get(g)
        if row is None:
            raise ConfigError(f"`nvidia-smi topo -m` text has no row for {g}: cut short?")
        codes = [c for c in row if _is_code(c)][:len(columns)]
        if len(codes) < len(gpu_cols):
            raise ConfigError(
                f"row {g} has {len(codes)} of {len(gpu_cols)} GPU cells: the text is cut short"
            )
        if len(codes) < len(columns):
            truncated = True
        for col, code in zip(columns, codes):
            cells[(g, col)] = code
    for a in range(len(gpu_cols)):
        for b in range(len(gpu_cols)):
            x, y = cells[(f"GPU{a}", f"GPU{b}")], cells[(f"GPU{b}", f"GPU{a}")]
            if (a == b) != (x == "X"):
                raise ConfigError(f"cell GPU{a}/GPU{b} is {x!r}: only the diagonal is X")
            if x != y:
                raise ConfigError(f"GPU{a}->GPU{b} is {x} but GPU{b}->GPU{a} is {y}")
    legend = {m.group(1): m.group(2) for ln in lines if (m := _LEGEND.match(ln))}
    names = tuple(legend.get(c, c) for c in nic_cols)
    if nic_cols and not any(c in rows for c in nic_cols):
        truncated = True  # NIC columns announced but no NIC rows printed
    return SmiMatrix(gpus=tuple(gpu_cols), nics=names, cells=cells, nic_columns=tuple(nic_cols),
                     truncated=truncated)
