"""The one device rule (launch.device): which device and backend each launcher's rank gets,
from its environment, without processes or GPUs (GPU counts are passed in)."""

import pytest

from atoll.config import EngineConfig
from atoll.errors import InputError
from atoll.launch.device import (DeviceError, agree, agree_through_store, backend_for, decide,
                                 local_rank_from_env)
from atoll.launch.local import local_devices

# each launcher's variables for the third rank of a node (local rank 2)
LAUNCHER_ENVS = {
    "torchrun": {"RANK": "10", "LOCAL_RANK": "2", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "10", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
    "mpich": {"PMI_RANK": "10", "MPI_LOCALRANKID": "2"},
    "slurm": {"SLURM_PROCID": "10", "SLURM_LOCALID": "2"},
}


@pytest.mark.parametrize("launcher", LAUNCHER_ENVS)
def test_local_rank_from_each_launcher(launcher):
    assert local_rank_from_env(LAUNCHER_ENVS[launcher]) == 2


def test_no_launcher_is_local_rank_0():
    assert local_rank_from_env({}) == 0
    assert local_rank_from_env({"LOCAL_RANK": "x"}) == 0  # garbage is not a rank


@pytest.mark.parametrize("launcher", LAUNCHER_ENVS)
@pytest.mark.parametrize("requested,gpus,device", [
    ("auto", 8, "cuda:2"), ("cuda", 8, "cuda:2"), ("cpu", 8, "cpu"),
    ("auto", 0, "cpu"), ("auto", 2, "cpu"),  # local rank 2 has no GPU of its own
])
def test_decide_per_launcher(launcher, requested, gpus, device):
    chosen = decide(requested, local_rank_from_env(LAUNCHER_ENVS[launcher]), gpus=gpus)
    assert chosen == device
    assert backend_for(chosen) == ("nccl" if device.startswith("cuda") else "gloo")


def test_ray_index_is_the_assigned_gpu_not_the_local_rank():
    assert decide("auto", 0, gpus=4, index=3) == "cuda:3"


def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(DeviceError, match="sees no GPU"):
        decide("cuda", 0, gpus=0)
    with pytest.raises(DeviceError, match="local rank 3 needs GPU 3 but this node shows 2"):
        decide("cuda", 3, gpus=2)
    with pytest.raises(DeviceError, match="not one of auto, cuda, cpu"):
        decide("tpu", 0, gpus=0)


def test_auto_is_cuda_only_when_every_rank_has_a_gpu():
    assert agree(["cuda:0", "cuda:1"], "auto") == ["cuda:0", "cuda:1"]
    assert agree(["cuda:0", "cpu"], "auto") == ["cpu", "cpu"]
    assert agree(["cpu", "cpu"], "cpu") == ["cpu", "cpu"]


def test_agreement_through_a_real_store():
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    store.set("atoll/device/1", "cpu")  # the other rank already checked in without a GPU
    assert agree_through_store(store, 0, 2, "cuda:0", "auto") == "cpu"
    store2 = dist.HashStore()
    store2.set("atoll/device/1", "cuda:1")
    store2.set_timeout(timedelta(seconds=5))
    assert agree_through_store(store2, 0, 2, "cuda:0", "auto") == "cuda:0"


def test_local_launcher_one_rank_per_gpu():
    assert local_devices("auto", 4, gpus=8) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert local_devices("auto", 4, gpus=0) == ["cpu"] * 4
    assert local_devices("cpu", 4, gpus=8) == ["cpu"] * 4
    with pytest.raises(DeviceError, match="4 ranks need 4 GPUs but this machine shows 2"):
        local_devices("auto", 4, gpus=2)
    with pytest.raises(DeviceError, match="sees no GPU"):
        local_devices("cuda", 2, gpus=0)


def test_torchrun_binds_from_its_environment(monkeypatch):
    """run_torchrun with one rank: the device rule reads LOCAL_RANK; CPU here."""
    from atoll.launch import device as dev
    from atoll.launch.torchrun import run_torchrun

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dev, "_bound", None)
    assert run_torchrun(lambda r, w: dev.rank_device(), 1, device="auto") == (0, "cpu")
    with pytest.raises(DeviceError, match="sees no GPU"):
        run_torchrun(lambda r, w: None, 1, device="cuda")


def test_default_dtype_follows_the_device(tiny_model):
    import torch

    from atoll.engine.rank.run_spec import resolve_dtype
    from atoll.models.config import ModelConfig

    cfg = ModelConfig.load(tiny_model("llama"))
    bf16 = type(cfg)(**{**cfg.__dict__, "raw": {**cfg.raw, "torch_dtype": "bfloat16"}})
    assert resolve_dtype(None, bf16, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, bf16, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", bf16, torch.device("cpu")) == torch.float16


@pytest.mark.parametrize("bad,match", [
    (dict(device="gpu"), "device 'gpu'"), (dict(dtype="int3"), "dtype 'int3'"),
    (dict(max_num_seqs=0), "max_num_seqs=0"), (dict(max_model_len=-5), "max_model_len=-5"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"), (dict(kv_cache_gb=0.0), "kv_cache_gb=0.0"),
])
def test_engine_config_names_the_bad_option(bad, match):
    with pytest.raises(InputError, match=match):
        EngineConfig(**bad)


def test_cli_flags_come_from_the_config():
    import argparse

    from atoll.config import add_cli_options, from_args

    p = argparse.ArgumentParser()
    add_cli_options(p)
    args = p.parse_args(["--device", "cpu", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "4"])
    assert from_args(args) == EngineConfig(device="cpu", gpu_memory_utilization=0.5, max_num_seqs=4)
    assert from_args(p.parse_args([])) == EngineConfig()  # one default each
