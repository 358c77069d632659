"""The seam to TorchRec's and torch's internals (``torchrec_mtrains._compat``), checked against
the installed packages: every private name it records exists where the record says, with the
parameters it expects on this release; the library's subclasses of TorchRec's classes define
only the private names recorded as overridden hooks; no private name is used outside the seam;
and the seam's functions reach a live sharded model, pipeline and planner.

Run it first after an upgrade: a TorchRec release that renamed or reshaped one of the names
fails here, naming it. CONTRIBUTING runs it on TorchRec 1.6.1 too (``PYTHONPATH`` at its
wheel). Names that differ between the releases checked are recorded with their parameters on
each (``parameters_by_version``): ``ShardedEmbeddingCollection._initialize_torch_state`` takes
``skip_registering`` on 1.8.0 and nothing on 1.6.1.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torchrec
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

import torchrec_mtrains
import torchrec_mtrains._compat
from torchrec_mtrains._compat import embedding as compat
from torchrec_mtrains._compat import pipeline as compat_pipeline
from torchrec_mtrains._compat import planner as compat_planner
from torchrec_mtrains._compat.registry import (
    REGISTRY,
    PrivateName,
    TorchRecCompatError,
    Use,
    private_attr,
)
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.kernel import TieredEmbedding, TieredEmbeddingBag

LIBRARY = Path(torchrec_mtrains.__file__).parent
SEAM = LIBRARY / "_compat"
FOREIGN = ("torch", "torchrec", "fbgemm_gpu")
"""Top-level packages whose private names may be used only in the seam."""

# Every seam module, for its records (each declares its own when imported).
for _seam in pkgutil.iter_modules(torchrec_mtrains._compat.__path__):
    importlib.import_module(f"torchrec_mtrains._compat.{_seam.name}")


def _installed(package: str) -> str:
    return {"torchrec": torchrec.__version__, "torch": torch.__version__.split("+")[0]}[package]


def _resolve(owner: str) -> Any:
    module, _, name = owner.partition(":")
    holder = importlib.import_module(module)
    return getattr(holder, name) if name else holder


@cache
def _source(holder: Any) -> str:
    """The source of ``holder`` (a module, or a class with its TorchRec / torch bases)."""
    if not inspect.isclass(holder):
        return inspect.getsource(holder)
    parts = []
    for cls in holder.__mro__:
        if cls.__module__.split(".")[0] in FOREIGN:
            try:
                parts.append(inspect.getsource(cls))
            except (OSError, TypeError):  # a class from a C extension
                continue
    return "\n".join(parts)


def _sets(holder: Any, name: str) -> bool:
    """Whether ``holder`` (or its bases) defines ``name``: as a class attribute, an attribute
    its methods set on ``self``, or a name set by string (``setattr``)."""
    if inspect.isclass(holder) and any(name in vars(cls) for cls in holder.__mro__):
        return True
    if not inspect.isclass(holder) and hasattr(holder, name):
        return True
    n = re.escape(name)
    return bool(re.search(rf"self\.{n}\b\s*[:=]|[\"']{n}[\"']", _source(holder)))


def _reads(holder: Any, name: str) -> bool:
    """Whether ``holder``'s source reads ``name`` off some object."""
    n = re.escape(name)
    return bool(re.search(rf"\.{n}\b|[\"']{n}[\"']", _source(holder)))


def _cases() -> Iterator[Any]:
    for record in REGISTRY:
        for owner in record.owners:
            where = owner.replace(":", ".")
            name = where if record.use is Use.IMPORTED else f"{where}.{record.name}"
            yield pytest.param(record, owner, id=name)


@pytest.mark.parametrize(("record", "owner"), list(_cases()))
def test_each_private_name_exists_where_recorded(record: PrivateName, owner: str) -> None:
    version = _installed(record.package)
    what = (
        f"{owner}: {record.name} ({record.use.value}) on {record.package} {version}, recorded "
        f"on {', '.join(record.checked_on)}; without it: {record.breaks}"
    )
    holder = _resolve(owner)  # an imported name: resolving it is the check
    if record.use is Use.IMPORTED:
        return
    if record.use is Use.PROVIDED:
        assert _reads(holder, record.name), f"{what}: TorchRec no longer reads it"
        return
    assert _sets(holder, record.name), f"{what}: missing"
    expected = record.expected_parameters(version)
    if expected is None:
        return
    found = tuple(inspect.signature(getattr(holder, record.name)).parameters)
    by_version = {v: record.expected_parameters(v) for v in record.checked_on}
    assert found == expected, (
        f"{what}: takes {found}, expected {expected} (by release: {by_version})"
    )


@pytest.mark.parametrize(
    "record",
    [r for r in REGISTRY if r.use is Use.OVERRIDDEN],
    ids=lambda r: f"{r.title}",
)
def test_overridden_hooks_are_defined_where_recorded(record: PrivateName) -> None:
    for where in record.overridden_in:
        cls = _resolve(where)
        ours = [c for c in cls.__mro__ if c.__module__.startswith("torchrec_mtrains.")]
        assert any(record.name in vars(c) for c in ours), f"{where} does not define {record.name}"


# ------------------------------------------------------------- the library's own names


def _library_files() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if SEAM not in p.parents)


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _string_arg(node: ast.Call, index: int) -> str | None:
    if len(node.args) > index and isinstance(node.args[index], ast.Constant):
        value = node.args[index].value
        return value if isinstance(value, str) else None
    return None


def _defined(tree: ast.AST) -> set[str]:
    """The private names ``tree`` defines: functions, classes, assignment targets (a bare
    annotation defines nothing) and names set by string (``setattr``, ``__setattr__``)."""
    names: set[str] = set()
    declared = {
        id(node.target)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and not node.value
    }
    for node in ast.walk(tree):
        if id(node) in declared:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if func in ("setattr", "__setattr__"):
                name = _string_arg(node, 1)
                if name is not None:
                    names.add(name)
    return {n for n in names if _private(n)}


@cache
def _library_defined() -> frozenset[str]:
    names: set[str] = set()
    for path in _library_files():
        names |= _defined(ast.parse(path.read_text()))
    return frozenset(names)


def _foreign_module(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


def _private_uses(path: Path) -> Iterator[str]:
    """Private names of other packages that ``path`` uses: imported from them (or from their
    private modules), or read off objects without the library defining them."""
    own = _library_defined()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and _foreign_module(node.module):
            if any(_private(part) for part in node.module.split(".")):
                yield f"{node.lineno}: from {node.module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield f"{node.lineno}: {alias.name} from {node.module}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign_module(alias.name) and any(
                    _private(part) for part in alias.name.split(".")
                ):
                    yield f"{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            yield f"{node.lineno}: .{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = _string_arg(node, 1)
            reflective = node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            if reflective and name and _private(name) and name not in own:
                yield f"{node.lineno}: {node.func.id}(..., {name!r})"


def test_no_private_name_is_used_outside_the_seam() -> None:
    found = [
        f"{path.relative_to(LIBRARY.parent)}:{use}"
        for path in _library_files()
        for use in _private_uses(path)
    ]
    assert not found, (
        "private names of TorchRec / fbgemm / torch used outside torchrec_mtrains/_compat "
        "(reach them through a function there, recorded with declare()):\n" + "\n".join(found)
    )


def _classes_on_torchrec() -> list[type]:
    """The library's classes with a TorchRec / torch / fbgemm base, each once."""
    found: dict[int, type] = {}
    for path in _library_files():
        module = importlib.import_module(_module_name(path))
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and any(_foreign_module(c.__module__) for c in value.__mro__[1:])
            ):
                found[id(value)] = value
    return list(found.values())


def _own_private_names(cls: type) -> set[str]:
    names: set[str] = set()
    for c in cls.__mro__:
        if c.__module__.startswith("torchrec_mtrains."):
            names |= {n for n in vars(c) if _private(n)}
            names |= _defined(ast.parse(textwrap.dedent(inspect.getsource(c))))
    return names


_MACHINERY = re.compile(r"_abc_\w+|_is_protocol|_is_runtime_protocol")


@pytest.mark.parametrize("cls", _classes_on_torchrec(), ids=lambda c: c.__qualname__)
def test_library_classes_override_only_recorded_hooks(cls: type) -> None:
    """A private name a library subclass defines that its TorchRec / torch bases define too
    must be a recorded hook: otherwise a new TorchRec release that starts using one of our
    names would silently call ours (or we theirs)."""
    foreign = [c for c in cls.__mro__ if _foreign_module(c.__module__) and c is not object]
    clashes = {
        name
        for name in _own_private_names(cls)
        if not _MACHINERY.fullmatch(name) and any(_sets(c, name) for c in foreign)
    }
    where = {f"{c.__module__}:{c.__qualname__}" for c in cls.__mro__}
    recorded = {
        r.name
        for r in REGISTRY
        if r.use in (Use.OVERRIDDEN, Use.PROVIDED) and where & set(r.overridden_in)
    }
    assert clashes <= recorded, (
        f"{cls.__qualname__} defines {sorted(clashes - recorded)}, which its TorchRec / torch "
        "bases define too: rename them, or record them as overridden hooks in "
        "torchrec_mtrains/_compat"
    )


def test_a_missing_name_is_named() -> None:
    with pytest.raises(TorchRecCompatError, match=r"_embedding_shardings.*1\.8\.0, 1\.6\.1"):
        private_attr(object(), compat.EBC_SHARDINGS)


# ------------------------------------------------------------------------ live objects


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """One rank."""


FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def _tiered(plan: Any, names: list[str]) -> None:
    for name in names:
        plan[name] = TieredParameterSharding.wrap(
            plan[name], TieredTableOptions(tier="dram", cache_load_factor=0.5)
        )


def _ebc_model(root: Path) -> DistributedModelParallel:
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=64, feature_names=[f"f{i}"])
        for i, n in enumerate(["tw", "cw", "rw", "own"])
    ]
    sharder = TieredEmbeddingBagCollectionSharder(TierStorage(root=str(root)), fused_params=FUSED)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc,
        {
            "tw": table_wise(rank=0, compute_kernel=TIERED_KERNEL),
            "cw": column_wise(ranks=[0, 0], compute_kernel=TIERED_KERNEL),
            "rw": row_wise(compute_kernel=TIERED_KERNEL),
            "own": table_wise(rank=0, compute_kernel="fused"),
        },
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    _tiered(plan, ["tw", "cw", "rw"])
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def test_the_seam_reaches_a_sharded_ebc(tmp_path: Path) -> None:
    model = _ebc_model(tmp_path)
    ebc = model.module
    assert compat.module_env(ebc).world_size == 1
    assert compat.module_device(ebc) == torch.device("cpu")
    assert [c.name for c in compat.table_configs(ebc)] == ["tw", "cw", "rw", "own"]
    assert set(compat.sharded_tensors(ebc)) == {"tw", "cw", "rw", "own"}
    shardings = compat.module_shardings(ebc)
    assert len(shardings) == len(compat.module_lookups(ebc)) == 3  # TW, CW, RW
    for sharding in shardings:
        args = compat.lookup_args(sharding)
        assert args.device == torch.device("cpu") and args.env.world_size == 1
        assert compat.keeps_groups_per_rank(sharding)
        assert compat.groups(sharding) == compat.groups_per_rank(sharding)[0]
    kernels = [k for lookup in compat.module_lookups(ebc) for k in compat.lookup_kernels(lookup)]
    assert all(isinstance(k, TieredEmbeddingBag) for k in kernels)
    for lookup in compat.module_lookups(ebc):
        assert len(compat.lookup_feature_splits(lookup)) == len(compat.lookup_kernels(lookup))
    for kernel in kernels:
        assert compat.emb_module(kernel) is kernel.emb_module
        assert compat.kernel_pg(kernel) is not None
        assert len(compat.kernel_local_cols(kernel)) == len(kernel.config.embedding_tables)
        assert compat.kernel_feature_table_map(kernel)
        compat.kernel_pooling(kernel)
    # "own" (FUSED) is a resident table of the table-wise tiered kernel, marked as FUSED's is.
    params = dict(model.named_parameters())
    own = params["embedding_bags.own.weight"]
    assert private_attr(own, compat.IN_BACKWARD_OPTIMIZERS)


def test_the_seam_reaches_a_sharded_ec(tmp_path: Path) -> None:
    tables = [
        EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=64, feature_names=[f"f{i}"])
        for i, n in enumerate(["tw", "own"])
    ]
    sharder = TieredEmbeddingCollectionSharder(TierStorage(root=str(tmp_path)), fused_params=FUSED)
    ec = EmbeddingCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ec,
        {
            "tw": table_wise(rank=0, compute_kernel=TIERED_KERNEL),
            "own": table_wise(rank=0, compute_kernel="fused"),
        },
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    _tiered(plan, ["tw"])
    model = DistributedModelParallel(
        ec, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )
    module = model.module
    assert [c.name for c in compat.table_configs(module)] == ["tw", "own"]
    assert list(compat.module_updates(module)) == []
    assert compat.index_dedup(sharder) is False
    (lookup,) = compat.module_lookups(module)
    (kernel,) = compat.lookup_kernels(lookup)
    assert isinstance(kernel, TieredEmbedding)
    assert compat.emb_module(kernel).table_names == ["tw", "own"]


def test_the_seam_reaches_a_pipeline_and_a_planner(tmp_path: Path) -> None:
    from torchrec_mtrains.pipeline import LookaheadTrainPipeline
    from torchrec_mtrains.planner import load_topology, plan_tables
    from torchrec_mtrains.planner.planners import _HostReservation

    model = _ebc_model(tmp_path)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    pipeline: LookaheadTrainPipeline[Any, Any] = LookaheadTrainPipeline(
        model, optimizer, torch.device("cpu")
    )
    internals = compat_pipeline.SparseDistInternals[Any, Any](pipeline)
    assert internals.model is model and internals.optimizer is optimizer
    assert internals.model_attached and internals.pipelined_modules == []
    with internals.on_data_dist_stream():  # no side stream on CPU
        pass
    assert private_attr(pipeline, compat_pipeline.PIPELINED_FORWARD_TYPE) is (
        LookaheadTrainPipeline._pipelined_forward_type
    )
    assert private_attr(_HostReservation(), compat_planner.RESERVATION_PERCENTAGE) == 0.0
    tables = [
        EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000, feature_names=["f"])
    ]
    plan, _ = plan_tables(tables, load_topology("local"), 1, 64, None)
    assert set(plan) == {"t"}
