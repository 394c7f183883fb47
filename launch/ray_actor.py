"""One rank of the Ray launcher: the actor class each rank runs in (made a Ray actor by
ray.remote at launch; Ray is imported lazily), and which of its node's GPUs it computes on."""

from __future__ import annotations

import os
import traceback

from atoll.launch.rank import call_rank

# Ray's switch (ray/_private/accelerators/nvidia_gpu.py) to leave CUDA_VISIBLE_DEVICES alone
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
GPU_INDEX_VAR = "ATOLL_GPU_INDEX"  # set in each GPU rank's actor: the CUDA index it computes on


class _RankActor:
    """One rank. Made a Ray actor class by ray.remote at launch (Ray is imported lazily)."""

    def held(self, gpus: bool) -> tuple[str, int | None]:
        """(this actor's Ray node id, the CUDA index of the GPU it holds, or None)."""
        import ray

        index = gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")) if gpus else None
        return ray.get_runtime_context().get_node_id(), index

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 only: a socket on this node's IP, held until run() hands it to the store."""
        import ray

        from atoll.launch.net import listen_socket

        ip = ray.util.get_node_ip_address()
        self._listen = listen_socket(ip)
        return ip, self._listen.getsockname()[1]

    def run(self, fn, rank, world_size, addr, port, requested, local_rank, args, kwargs):
        """requested: the job's device, or "cpu" when the job reserved no GPU."""
        try:
            import ray
            import torch

            from atoll.launch.device import bind, decide
            from atoll.launch.net import NODE_VAR, pin_interface, rendezvous

            os.environ[NODE_VAR] = ray.get_runtime_context().get_node_id()
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
            index = None
            if requested != "cpu":  # this actor holds one GPU; it sees all of its node's
                index = gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
                os.environ[GPU_INDEX_VAR] = str(index)
            device = decide(requested, local_rank, index=index)
            if world_size > 1:
                pin_interface(ray.util.get_node_ip_address())
                rendezvous(rank, world_size, addr, port, device=device, requested=requested,
                           listen=getattr(self, "_listen", None))
            else:
                bind(device)
            return ("ok", call_rank(fn, rank, world_size, args, kwargs))
        except BaseException as e:  # report to the driver; the driver kills every actor
            from atoll.errors import AtollError

            line = str(e) if isinstance(e, AtollError) else f"{type(e).__name__}: {e}"
            return ("error", line, traceback.format_exc())


def gpu_index(assigned_ids, cuda_visible_devices: str | None) -> int:
    """The CUDA index, among the devices this actor sees, of the one GPU Ray assigned it.

    assigned_ids: ray.get_gpu_ids(), which are the node's CUDA_VISIBLE_DEVICES entries when
    the node set that variable, else indices into the node's GPUs. cuda_visible_devices: this
    actor's CUDA_VISIBLE_DEVICES (left as the node's, since Ray was told not to narrow it).
    """
    from atoll.launch.device import DeviceError

    ids = [str(i).strip() for i in assigned_ids]
    if len(ids) != 1:
        raise DeviceError(f"expected Ray to assign this rank one GPU, got {ids or 'none'}")
    if cuda_visible_devices is None:
        return int(ids[0])
    visible = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if ids[0] not in visible:
        raise DeviceError(f"Ray assigned GPU {ids[0]} but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
                          f"does not list it")
    return visible.index(ids[0])
