"""Which GPU each rank and each of its threads computes on, checked on the CPU through a fake of torch.cuda whose
current device is per thread, as CUDA's is (a thread starts on GPU 0; set_device(torch.device("cuda")) raises).
One lent GPU cannot host two NCCL ranks, so the bugs of torchrun and of --devices cuda:1,cuda:2 are pinned here."""

import threading

import pytest
import torch
from conftest import RECIPES

from quantize import recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import devices, distributed, stream
from quantize.engine.ordered import single_threaded
from quantize.errors import UsageError
from quantize.tensor_plan import build


class FakeCuda:
    def __init__(self, count: int):
        self.count, self.local = count, threading.local()

    def set_device(self, d) -> None:
        index = d if isinstance(d, int) else torch.device(d).index
        if index is None:  # what torch.cuda.set_device says of a device without an index
            raise ValueError(f"Expected a cuda device with a specified index or an integer, but got:{d}")
        self.local.current = index

    def current_device(self) -> int:
        return getattr(self.local, "current", 0)


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda(4)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(devices, "_bound", None)
    return fake


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_a_torchrun_rank_binds_the_gpu_of_its_local_rank(cuda, monkeypatch, device):
    """`torchrun --nproc-per-node 2 -m quantize convert ... --device cuda|auto`: rank 1 is GPU 1, current in its
    main thread and bound for its threads; NCCL is its backend. It used to pass torch.device("cuda") to
    set_device (ValueError), and every rank took GPU 0."""
    groups = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: groups.append((backend, kw)))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    fake_store(monkeypatch, {0: "node-a GPU-0"})
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    dev = devices.torchrun_device(device, TORCHRUN, devices.visible_gpus())
    assert dev == "cuda:1"
    assert distributed.init_torchrun(dev) == 1
    assert cuda.current_device() == 1 and devices.bound() == torch.device("cuda", 1)
    assert groups[0][0] == "nccl" and groups[0][1]["rank"] == 1


def fake_store(monkeypatch, others: dict[int, str]) -> None:
    """torchrun's store as init_torchrun reads it: what the other ranks wrote ("host uuid"), and this one's GPU
    named by its index."""
    from types import SimpleNamespace

    class Store(dict):
        def set(self, k, v):
            self[k] = v.encode()

        def get(self, k):
            return dict.__getitem__(self, k)

    store = Store({f"quantize/gpu/{r}": v.encode() for r, v in others.items()})
    monkeypatch.setattr(distributed.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 1 + len(others))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(uuid=f"GPU-{torch.device(d).index}"))
    monkeypatch.setattr("socket.gethostname", lambda: "node-a")


def test_torchrun_with_one_visible_gpu_per_process_or_no_local_world_size_is_served(cuda, monkeypatch):
    """SLURM's --gpus-per-task=1 gives each process one visible GPU: it is cuda:0 of every rank, whatever
    LOCAL_RANK says (it used to be refused, LOCAL_WORLD_SIZE 2 > 1 visible). A multi-node launcher that does not
    set LOCAL_WORLD_SIZE no longer falls back to WORLD_SIZE."""
    assert devices.torchrun_device("cuda", TORCHRUN, 1) == "cuda:0"
    assert devices.torchrun_device("auto", {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, 8) == "cuda:1"
    assert devices.torchrun_device("cuda:0", TORCHRUN, 1) == "cuda:0"  # the one GPU this process sees
    assert devices.shared_gpu(["a GPU-0", "a GPU-1", "b GPU-0"]) is None  # the same uuid on two hosts is no clash
    assert devices.shared_gpu(["a GPU-0", "a GPU-1", "a GPU-1"]) == (1, 2)


def test_torchrun_ranks_on_one_gpu_are_refused_before_nccl_runs(cuda, monkeypatch):
    """Two processes that see one GPU each, the same one (a launcher that gives every rank CUDA_VISIBLE_DEVICES=0):
    found through torchrun's store before any NCCL call, which would fail in NCCL's own words."""
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    fake_store(monkeypatch, {0: "node-a GPU-0"})
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match=r"torchrun ranks 0 and 1 run on the same GPU .* --nproc-per-node 4"):
        distributed.init_torchrun(devices.torchrun_device("cuda", TORCHRUN, 1))


def test_torchrun_and_devices_that_nccl_cannot_run_are_refused_in_one_line(cuda):
    for bad, words in (
        (lambda: devices.torchrun_device("cuda:0", TORCHRUN, 4), "puts all 2 ranks of this machine on one GPU"),
        (lambda: devices.torchrun_device("cuda", TORCHRUN | {"LOCAL_RANK": "3"}, 2), "use --nproc-per-node 2 or fewer"),
        (lambda: devices.check_devices(["cuda:0", "cuda:0"], 4), "names cuda:0 twice"),
        (lambda: devices.check_devices(["cuda:0", "cpu"], 4), "mixes cpu and cuda"),
        (lambda: devices.check_devices(["cuda", "cuda"], 4), "a bare cuda"),
        (lambda: devices.check_devices(["cuda:0", "cuda:4"], 4), "--devices cuda:4: 4 GPU(s) are visible"),
        (lambda: devices.check_devices(["gpu0"], 4), "expected cpu or cuda:N"),
    ):
        with pytest.raises(UsageError) as e:
            bad()
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    devices.check_devices(["cpu", "cpu"], 0)  # CPU ranks may share the CPU
    devices.check_devices(["cuda:1", "cuda:2"], 4)
    assert devices.torchrun_device("auto", TORCHRUN, 0) == "cpu"


def test_every_thread_the_engine_starts_computes_and_stages_on_the_ranks_gpu(cuda, fixtures_dir, tmp_path, monkeypatch):
    """`--devices cuda:1,cuda:2`: rank 0 binds cuda:1 in its main thread, and the engine runs in stream.run's
    writer threads, which CUDA starts on GPU 0. Each of them must have cuda:1 current, and what is staged for NCCL
    goes to cuda:1 (it went to cuda:current_device(), GPU 0 there). The math itself runs on the CPU here."""
    devices.bind("cuda:1")
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "nccl")
    staged, seen = [], []

    class Engine:  # layerwise.Calibrated as stream.run drives it: the writers call produce
        rank, world = 0, 1

        def start(self, partials, todo):
            return self

        def produce(self, entry):
            seen.append((threading.current_thread().name, cuda.current_device()))
            assert distributed._staged(torch.zeros(1))  # a host piece under NCCL goes through the bound GPU
            staged.append(devices.bound())
            return None

        def stop_loop(self):
            pass

        def shard_written(self, i, pair):
            pass

        def join(self, stats):
            pass

    plan = build(Checkpoint(fixtures_dir / "llama-bf16"), recipe.load(RECIPES / "dense-w4a16.yaml"), 2**20)
    stream.run(plan, tmp_path / "out", device="cpu", calibrated=Engine())
    assert seen and all(t != threading.main_thread().name and d == 1 for t, d in seen), seen
    assert staged and all(torch.device(d) == torch.device("cuda", 1) for d in staged), staged
    with single_threaded(2) as pool:  # the experts' chunk threads
        assert {pool.submit(cuda.current_device).result() for _ in range(4)} == {1}
    with devices.pool(1) as pool:  # the layer checkpoint's saver
        assert pool.submit(cuda.current_device).result() == 1
    # a bare thread still starts on GPU 0, which is why the engine makes its threads through devices.pool
    t = threading.Thread(target=lambda: seen.append(("bare", cuda.current_device())))
    t.start()
    t.join()
    assert seen[-1] == ("bare", 0)
