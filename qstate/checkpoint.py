"""``torch.distributed.checkpoint`` loading that validates before it writes.

``dcp.load`` copies each stored piece into its destination as it reads it, and a copy converts:
a stored :class:`~qstate.QuantizedState` copied into a plain tensor is dequantized, a stored plain
tensor copied into a state is encoded, so a checkpoint of another format would load silently or
fail half way. :func:`load` reads into a staging copy of the destination (one extra copy of the
states while loading), checks what the checkpoint stored against each destination and the
policy options of qstate's param groups, and copies into the live tensors only when all matched.

* all or nothing: when :func:`load` raises, no tensor and no value of its ``state_dict`` has
  changed, model tensors included;
* loading runs no code from the checkpoint: the metadata is unpickled by
  :class:`SafeFileSystemReader`, non-tensor entries with ``torch.load(weights_only=True)``
  (:class:`NamingLoadPlanner`), and every stored state is checked whole when unpickled;
* nothing converts: a checkpoint of another state policy loads into an optimizer of its own
  policy, and :func:`qstate.optim.convert_state_dict` converts from there.

Saving needs nothing special: ``dcp.save`` stores quantized DTensor states shard by shard, and
loading at another world size moves whole rows, exactly.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils._pytree import tree_map_only

from ._dtensor import state_kind
from ._state import QuantizedState

__all__ = ["load", "NamingLoadPlanner", "SafeFileSystemReader"]

_aten = torch.ops.aten


class _CheckedTarget(torch.Tensor):
    """A staging destination that checks what a storage reader copies into it.

    Readers copy each stored piece into the tensor the planner resolves
    (``target.detach().copy_(stored)``). This wrapper raises unless the stored
    piece has the destination's kind (:func:`qstate.distributed.state_kind`:
    format, signedness, block size, rounding; or plain), then copies; every
    other op runs on the wrapped tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, key: str):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=inner.device, requires_grad=False)
        t.inner, t.key = inner, key
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"_CheckedTarget({self.key!r}, {self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.copy_.default and isinstance(args[0], cls):
            dst, src = args
            expected, found = state_kind(dst.inner), state_kind(src)
            quantized = isinstance(dst.inner, QuantizedState) or isinstance(src, QuantizedState)
            if quantized and expected != found:
                raise ValueError(f"{dst.key!r}: expected a {expected} state (the destination's), the checkpoint "
                                 f"stores a {found} state; loading never converts states")
            dst.inner.copy_(src)
            return dst
        if func is _aten.detach.default and isinstance(args[0], cls):
            return cls(args[0].inner, args[0].key)
        args, kwargs = tree_map_only(cls, lambda t: t.inner, (args, kwargs))
        return func(*args, **kwargs)


class NamingLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that names each quantized destination after its key, and (with
    ``check_stored_kinds``) resolves each destination to a wrapper that raises unless what the
    checkpoint stored there is a state of the destination's kind (quantized or plain)."""

    def __init__(self, *args: Any, check_stored_kinds: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.check_stored_kinds = check_stored_kinds

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """A non-tensor entry, read with ``torch.load(weights_only=True)`` (``DefaultLoadPlanner``'s
        reads it with ``weights_only=False``, which runs any callable the entry names)."""
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = [line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()]
            first = lines[0] if lines else str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{fqn!r}: the checkpoint stores something other than the plain values a state dict "
                             f"holds (ints, floats, strs, tensors, lists, dicts...); never loaded: {first}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def resolve_tensor(self, read_item):
        tensor = super().resolve_tensor(read_item)
        if isinstance(tensor, QuantizedState):
            tensor.state_name = read_item.dest_index.fqn
        if self.check_stored_kinds:
            return _CheckedTarget(tensor, read_item.dest_index.fqn)
        return tensor


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` file may name: DCP's metadata classes (dataclasses and enums of
    ``torch.distributed.checkpoint.metadata``), the file system reader's ``_StorageInfo``, ``torch.Size``,
    dtypes, ``torch.serialization._get_layout`` (a layout by name) and paths."""
    allowed: dict[tuple[str, str], Any] = {}
    for name, obj in vars(dcp_metadata).items():
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__ and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            allowed[dcp_metadata.__name__, name] = obj
    allowed[dcp_filesystem.__name__, "_StorageInfo"] = dcp_filesystem._StorageInfo
    allowed["torch", "Size"] = torch.Size
    for name, obj in vars(torch).items():
        if isinstance(obj, torch.dtype):
            allowed["torch", name] = obj
    get_layout = getattr(torch.serialization, "_get_layout", None)  # how TensorProperties pickles its layout
    if get_layout is not None:
        allowed["torch.serialization", "_get_layout"] = get_layout
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed["pathlib", name] = getattr(pathlib, name)
    allowed["collections", "OrderedDict"] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :func:`_metadata_classes` lists: a metadata file never runs code."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP's metadata never holds")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is unpickled with a restricted unpickler that builds
    only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths (``FileSystemReader``'s
    ``pickle.load`` runs any callable the file names); anything else raises ``ValueError``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not _MetadataUnpickler.allowed:
            _MetadataUnpickler.allowed = _metadata_classes()
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"checkpoint not loaded: its metadata {str(path)!r} is not DCP's metadata "
                                 f"({e}); never loaded") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ValueError(f"checkpoint not loaded: its metadata {str(path)!r} holds a "
                             f"{type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """``FileSystemReader.read_data``, entry by entry, so that an entry that fails to load (a
        malformed state: :func:`qstate._state.check_parts`) is named by its key."""
        for item in plan.items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except ValueError as e:
                fqn = item.dest_index.fqn
                if str(e).startswith(repr(fqn)):
                    raise
                raise ValueError(f"{fqn!r}: {e}") from None
        return _done()


def _done():
    from torch.futures import Future

    fut: Future = Future()
    fut.set_result(None)
    return fut


def _reader(checkpoint_id: Any, storage_reader: Any) -> Any:
    """The storage reader :func:`load` uses: the caller's, else a :class:`SafeFileSystemReader` of the
    ``checkpoint_id`` folder."""
    if storage_reader is not None:
        return storage_reader
    if checkpoint_id is None or not dcp.FileSystemReader.validate_checkpoint_id(checkpoint_id):
        raise ValueError(f"qstate.checkpoint.load: expected checkpoint_id to be a checkpoint folder, got "
                         f"{checkpoint_id!r}; for other storage pass a storage_reader whose metadata reads run no code")
    return SafeFileSystemReader(checkpoint_id)


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_reader: Any = None,
         process_group: Optional[Any] = None) -> None:
    """``dcp.load`` into ``state_dict`` in place, all or nothing.

    Raises ``ValueError`` and leaves every tensor and value of ``state_dict``
    unchanged when the checkpoint stores a state of another kind than its
    destination (a quantized state for a plain one or the reverse, another
    format, block size, signedness or rounding: naming the key, the expected
    and the found), when a param group of a qstate optimizer
    (``get_optimizer_state_dict``) has policy options (``state_format``,
    ``block_size``, ``state_rounding``, ``min_quantize_numel``) other than the
    destination's, when a stored state is malformed (:func:`qstate._state.check_parts`),
    when the checkpoint holds anything but DCP's metadata, tensors, states and plain
    values (which :func:`load` never builds: no code from the checkpoint runs), or when
    ``dcp.load`` fails otherwise (a missing key, a shape). Plain tensors that are not
    optimizer states load as ``dcp.load`` loads them.

    ``checkpoint_id``: a checkpoint folder, read with :class:`SafeFileSystemReader`; other
    storage needs a ``storage_reader``, whose metadata reads are its own (non-tensor entries
    are still read with ``weights_only=True``).
    """
    staging = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state_dict)
    try:
        dcp.load(staging, checkpoint_id=checkpoint_id, storage_reader=_reader(checkpoint_id, storage_reader),
                 planner=NamingLoadPlanner(check_stored_kinds=True), process_group=process_group)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]
        raise ValueError(f"checkpoint not loaded, states unchanged: {first}") from None
    _check_policy_options(state_dict, staging, "")
    _copy_tree(state_dict, staging)


def _check_policy_options(dst: Any, src: Any, path: str) -> None:
    """Raise unless every qstate param group in ``dst`` (a dict with a ``state_format``) has the
    policy options of its loaded copy ``src``: loading never changes an optimizer's state policy."""
    from .optim._policy import POLICY_OPTIONS

    if isinstance(dst, dict):
        if "state_format" in dst and isinstance(src, dict):
            for option in POLICY_OPTIONS:
                if option in dst and option in src and src[option] != dst[option]:
                    raise ValueError(f"checkpoint not loaded, states unchanged: {path}{option}: expected "
                                     f"{dst[option]!r} (the optimizer's), the checkpoint has {src[option]!r}; "
                                     "loading never converts states (see qstate.optim.convert_state_dict)")
        items = [(k, v, src.get(k) if isinstance(src, dict) else None) for k, v in dst.items()]
    elif isinstance(dst, (list, tuple)) and isinstance(src, (list, tuple)):
        items = list(zip(range(len(dst)), dst, src))
    else:
        return
    for key, d, s in items:
        _check_policy_options(d, s, f"{path}{key}.")


def _copy_tree(dst: Any, src: Any) -> None:
    for key, value in src.items():
        if isinstance(value, torch.Tensor):
            dst[key].detach().copy_(value)
        elif isinstance(value, dict):
            _copy_tree(dst[key], value)
        else:
            dst[key] = value
