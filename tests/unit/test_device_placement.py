"""Where tpify puts what it builds, in one process without a GPU (torch.cuda and torch.distributed
answers monkeypatched; FakeTensors stand for CUDA parameters).

What it proves:

* the DeviceMesh's device (``init_mesh``, the mesh ``parallelize`` builds, the checkpoint's TP
  mesh) comes from the tensors and from CUDA being usable, for every backend string:
  ``"gloo"``, ``"nccl"``, ``"undefined"`` (``init_process_group()`` with no backend) and
  ``"cpu:gloo,cuda:nccl"``; before, only ``"nccl"`` gave a CUDA mesh, so FSDP2 moved the
  parameters of the others to the CPU and DCP copied every shard to the host;
* under NCCL, ranks of one host on one GPU (no ``torch.cuda.set_device(LOCAL_RANK)``) raise the
  same error on every rank in the agreement, naming ``set_device`` and ``CUDA_VISIBLE_DEVICES``;
  gloo (several ranks per GPU) and ranks that have not touched CUDA pass;
* barriers over NCCL alone run on this rank's current device (``device_ids``).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tpify import agree, comm, mesh

#: backend string -> what torch's backend configuration reports for it on a CUDA host (torch 2.13)
BACKENDS = {"gloo": "cpu:gloo,cuda:gloo", "nccl": "cuda:nccl", "undefined": "cuda:nccl",
            "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl"}


def _process_group(monkeypatch, backend: str, cuda: bool, world: int = 2, rank: int = 0, device: int = 0):
    """Make this process look like rank ``rank`` of ``world`` initialised with ``backend``."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: BACKENDS[backend] if cuda else "cpu:gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)


def _on_cuda_model() -> nn.Module:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Module()
    with FakeTensorMode():
        weight = torch.empty(4, 4, device="cuda")
    model.weight = nn.Parameter(weight)
    return model


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_mesh_device_comes_from_the_tensors_and_cuda_never_from_the_backend_string(monkeypatch, backend):
    built = []

    class _Mesh:
        def __getitem__(self, names):
            return SimpleNamespace(_flatten=lambda name: None)

    def fake_init_device_mesh(device_type, shape, mesh_dim_names):
        built.append(device_type)
        return _Mesh()

    monkeypatch.setattr(mesh, "init_device_mesh", fake_init_device_mesh)
    monkeypatch.setattr(agree, "agree", lambda *a, **k: ["host", "host"])  # init_mesh's agreement
    monkeypatch.setattr(mesh, "_meshes", {})
    for cuda in (True, False):
        _process_group(monkeypatch, backend, cuda)
        want = "cuda" if cuda else "cpu"
        assert mesh.mesh_device_type() == want, (backend, cuda)
        assert mesh.mesh_device_type(nn.Linear(2, 2)) == want, "a CPU model is moved to its GPU later"
        assert mesh.mesh_device_type(nn.Linear(2, 2, device="meta")) == want, "from_pretrained's meta model"
        mesh.init_mesh(2)
        assert built[-1] == want, (backend, cuda, built)
        mesh.init_mesh(2, device_type="cpu")  # training on the CPU of a GPU host
        assert built[-1] == "cpu"
    _process_group(monkeypatch, backend, True)
    assert mesh.mesh_device_type(_on_cuda_model()) == "cuda"
    assert mesh.model_device_type(_on_cuda_model()) == "cuda"
    assert mesh.model_device_type(nn.Linear(2, 2, device="meta")) is None


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_checkpoints_tp_mesh_is_on_the_device_of_the_shards(monkeypatch, backend):
    from torch.distributed.device_mesh import DeviceMesh

    from tpify import checkpoint

    made = []
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device: made.append(device) or device))
    info = SimpleNamespace(tp_size=2, tp_rank=0, mesh=None, tp_group=object(), tp_meshes={})
    monkeypatch.setattr(checkpoint, "get_tp_info", lambda model: info)
    for model, cuda, want in ((_on_cuda_model(), True, "cuda"), (nn.Linear(2, 2), True, "cpu"),
                              (nn.Linear(2, 2), False, "cpu")):
        monkeypatch.setattr(checkpoint, "find_tp_model", lambda m, model=model: model)
        _process_group(monkeypatch, backend, cuda)
        assert checkpoint._context(model).mesh == want, (backend, cuda, want)
    assert made == ["cuda", "cpu"], made  # made once per (group, device)


def _agree_as(monkeypatch, rank: int, placements: list) -> None:
    """Run ``agree`` as ``rank`` of ``len(placements)`` ranks whose device placements are given."""
    monkeypatch.setattr(agree, "group_size", lambda group=None: len(placements))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(placements))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(agree, "device_placement", lambda: placements[rank])
    monkeypatch.setattr(agree, "_exchange", lambda what, mine, ranks: [({"tp": 2}, None, None, p) for p in placements])
    agree.agree("tpify.parallelize", {"tp": 2})


def test_ranks_of_one_host_on_one_gpu_under_nccl_raise_on_every_rank_naming_set_device(monkeypatch):
    same_gpu = [("node", "0", 0, True), ("node", "1", 0, True)]  # .cuda() without set_device
    messages = []
    for rank in (0, 1):
        with pytest.raises(agree.AgreementError) as caught:
            _agree_as(monkeypatch, rank, same_gpu)
        messages.append(str(caught.value))
    assert messages[0] == messages[1], "every rank must raise the same error"
    for part in ("ranks [0, 1]", "LOCAL_RANK ['0', '1']", "cuda:0", "CUDA_VISIBLE_DEVICES", "tpify.parallelize",
                 "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))"):
        assert part in messages[0], (part, messages[0])
    # One GPU per rank, gloo's several ranks per GPU, two hosts, ranks that never touched CUDA: no error.
    for fine in ([("node", "0", 0, True), ("node", "1", 1, True)],
                 [("node", "0", 0, False), ("node", "1", 0, False)],
                 [("a", "0", 0, True), ("b", "0", 0, True)],
                 [("node", "0", None, True), ("node", "1", None, True)]):
        _agree_as(monkeypatch, 0, fine)


def test_device_placement_reads_the_cuda_device_only_once_cuda_is_initialised(monkeypatch):
    _process_group(monkeypatch, "nccl", cuda=True, device=3)
    monkeypatch.setenv("LOCAL_RANK", "3")
    host, local_rank, index, nccl = agree.device_placement()
    assert (local_rank, index, nccl) == ("3", 3, True) and host == agree.host_of_rank()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("would create a context on GPU 0"))
    assert agree.device_placement()[2] is None
    _process_group(monkeypatch, "cpu:gloo,cuda:nccl", cuda=True)
    assert agree.device_placement()[3] is True
    _process_group(monkeypatch, "gloo", cuda=True)
    assert agree.device_placement()[3] is False


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_barrier_runs_on_this_ranks_gpu_when_nccl_alone_serves_the_group(monkeypatch, backend):
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: calls.append(kw))
    _process_group(monkeypatch, backend, cuda=True, device=1)
    comm.barrier()
    cuda_only = "cpu" not in BACKENDS[backend]
    assert calls[-1] == ({"device_ids": [1]} if cuda_only else {}), (backend, calls)
    assert comm.collective_device() == (torch.device("cuda", 1) if cuda_only else torch.device("cpu"))
    _process_group(monkeypatch, backend, cuda=False)
    comm.barrier()
    assert calls[-1] == {}
