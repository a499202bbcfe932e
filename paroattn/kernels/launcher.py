"""Launching a Triton or Gluon kernel with less host work than `kernel[grid](...)`.

Each `kernel[grid](*args)` binds the arguments to the signature, computes the specialization of every
argument (dtype and 16-byte alignment of each pointer, divisibility of each integer), hashes it to find
the compiled kernel, then calls the compiled kernel's launcher: for the attention kernel's 43 arguments
most of the host time of a call (docs/notes/host-overhead.md). A
`CachedLauncher` does the full launch the first time it sees a key and keeps the compiled kernel it
returns; later launches with that key call the compiled kernel's launcher directly.

The key is the caller's promise: two launches with one key have one specialization. Callers key on
what their arguments can vary in: shapes, strides, integer arguments, dtypes and the 16-byte alignment
of each tensor's address (`aligned`); floats and the addresses themselves are not specialized on. The
constexprs, the launch options and the current device are added to the key here.

Below Triton's launcher (`CompiledKernel.run`, a Python object) is a generated C function that parses
the arguments and launches. It asks each tensor argument for its address and the driver whether that
address is a device pointer, and, wrapped by the Python launcher, encodes every tensor descriptor into a
CUDA tensor map, on every launch. Where the launcher is the one this was checked against (triton 3.6:
`_raw_launch`), a direct launch calls the C function itself with addresses as integers and each
descriptor's encoding made once and kept (descriptors are immutable; the callers keep theirs with their
buffers; an encoding is kept while its descriptor lives). Anything else takes the Python launcher.

A `LaunchSequence` goes one step further for a caller that makes the same launches call after call into
buffers it keeps: the launches of one call are recorded (`Recording`) with their arguments ready for the
C function, and a later call with the same key replays them with its own tensors put in their places,
none of the callers' Python between the launches run again. `LaunchSequences` keeps the sequences recorded
into one set of buffers, by key: `replay(key, ...)`, else `with recording(key, ...):` the call's launches.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from triton.runtime import driver

from . import interpreting

try:
    from triton import knobs
except ImportError:  # pragma: no cover - triton releases before knobs: full launches only
    knobs = None
try:
    from triton.backends.nvidia import driver as nvidia_driver
except ImportError:  # pragma: no cover - no CUDA backend: the Python launcher only
    nvidia_driver = None

# the C function's leading arguments, as `_Entry` passes them: grid x, y, z, stream, function, cooperative
# grid, PDL, global and profile scratch, packed metadata, launch metadata, enter and exit hooks
RAW_LAUNCH_FORMAT = "iiiKKppOOOOOO"

# encodings of descriptors kept per launch entry; beyond this many, the entry's are dropped (callers that
# make descriptors per call, as the custom op does off the default stream, would otherwise grow it without bound)
DESCRIPTOR_ENCODINGS = 64


def aligned(*tensors: torch.Tensor) -> int:
    """A bit per tensor: its address is a multiple of 16 bytes (what Triton specializes pointers on)."""
    bits = 0
    for t in tensors:
        bits = (bits << 1) | (t.data_ptr() % 16 == 0)
    return bits


def _raw_launch(compiled) -> tuple | None:
    """(the C launch function, {argument position: descriptor metadata}) under a compiled kernel's Python
    launcher, or None where that launcher is not the one this was checked against: triton 3.6's
    `CudaLauncher`, no scratch memory, its `launch` the C function or the closure
    `wrap_handle_tensordesc` makes around it. Not public API, hence every check."""
    if nvidia_driver is None or getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != RAW_LAUNCH_FORMAT:
        return None
    run = compiled.run
    launch = getattr(run, "launch", None)
    if (launch is None or type(run).__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1)
            or getattr(run, "profile_scratch_size", 1) or not hasattr(run, "launch_cooperative_grid")
            or not hasattr(run, "launch_pdl")):
        return None
    code = getattr(launch, "__code__", None)
    if code is None:  # the C function itself: the kernel takes no descriptors
        return launch, {}
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    positions = sorted(cells["tensordesc_indices"])
    metadata = cells["tensordesc_meta"] or [None] * len(positions)
    return cells["launcher"], dict(zip(positions, metadata))


class _Entry:
    """What a key's direct launches need: the compiled kernel and, where `_raw_launch` found it, its C
    launch function with the positions of the tensor and descriptor arguments."""

    __slots__ = ("compiled", "launch", "head", "pointers", "descriptors", "descriptor_positions", "encodings")

    def __init__(self, compiled, all_args: tuple):
        self.compiled = compiled
        raw = _raw_launch(compiled)
        self.launch = raw[0] if raw else None
        self.descriptors = raw[1] if raw else {}
        run = compiled.run
        # the C function's arguments between the grid and the kernel's: stream (per launch), function,
        # cooperative grid, PDL, global and profile scratch (none), packed metadata
        self.head = (compiled.function, getattr(run, "launch_cooperative_grid", False), getattr(run, "launch_pdl", False),
                     None, None, compiled.packed_metadata)
        # a key's arguments keep their kinds (the callers' promise), so where the tensors are is known
        self.pointers = tuple(i for i, a in enumerate(all_args) if isinstance(a, torch.Tensor))
        self.descriptor_positions = tuple(sorted(self.descriptors, reverse=True))
        self.encodings: dict = {}

    def encoded(self, descriptor, position: int) -> list:
        """The C function's arguments for the descriptor at `position`: its tensor map, shape and strides."""
        entry = self.encodings.get(id(descriptor))
        if entry is not None and entry[0]() is descriptor:
            return entry[1]
        encoding = nvidia_driver.make_tensordesc_arg(descriptor, self.descriptors[position])
        # kept by a weak reference: a descriptor must not keep its buffer alive (CUDA-graph trees refuse
        # memory of their pool that outlives a call), and a dead descriptor's id may come back for another.
        # An encoding that holds the tensor itself (descriptors without metadata) is not kept
        if not any(isinstance(value, torch.Tensor) for value in encoding):
            if len(self.encodings) >= DESCRIPTOR_ENCODINGS:
                self.encodings.clear()
            self.encodings[id(descriptor)] = (weakref.ref(descriptor), encoding)
        return encoding

    def arguments(self, all_args: tuple) -> list:
        """The kernel's arguments as the C function takes them: addresses, and descriptors encoded."""
        values = list(all_args)
        for i in self.pointers:
            values[i] = values[i].data_ptr()
        for i in self.descriptor_positions:  # from the end: earlier positions stay put
            values[i:i + 1] = self.encoded(values[i], i)
        return values


class LaunchState:
    """What the launchers of one process share (kept by `runtime.PROCESS`): the generation that recorded
    sequences must match to replay (bumped by whatever makes them stale: a launcher cleared or its direct path
    turned off), the recording in scope per thread (launches of another thread's calls must not enter it), and
    the launcher of each kernel."""

    def __init__(self):
        self.generation = 0
        self._recordings = threading.local()
        self._launchers: dict = {}

    def launcher(self, kernel) -> CachedLauncher:
        """The one `CachedLauncher` of `kernel` in this process."""
        launcher = self._launchers.get(kernel)
        if launcher is None:
            launcher = self._launchers[kernel] = CachedLauncher(kernel, self)
        return launcher

    def launchers(self) -> list[CachedLauncher]:
        return list(self._launchers.values())

    def invalidate_sequences(self) -> None:
        """Every `LaunchSequence` recorded so far declines to replay from now on."""
        self.generation += 1

    def clear(self) -> None:
        """`CachedLauncher.clear` of every launcher."""
        for launcher in self._launchers.values():
            launcher.clear()

    def recording(self) -> Recording:
        """`with state.recording() as records:` collects the launches made in its scope as (launcher, entry,
        grid, arguments); None for a launch no sequence can replay (a full launch, or no C function)."""
        return Recording(self._recordings)

    def record(self, launch) -> None:
        """Add `launch` (launcher, entry, grid, arguments; None: not replayable) to the recording in scope."""
        if (records := getattr(self._recordings, "records", None)) is not None:
            records.append(launch)


def _launch_hooks() -> tuple:
    """Triton's (enter, exit) launch hooks, each None where nothing is installed: profilers' hooks (proton)
    run as in a full launch, and an empty hook chain (releases whose hooks are `HookChain`s) calls nothing,
    so none is passed and no launch metadata is built for it."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if enter is not None and not getattr(enter, "calls", True):
        enter = None
    if leave is not None and not getattr(leave, "calls", True):
        leave = None
    return enter, leave


class Recording:
    def __init__(self, recordings: threading.local):
        self._recordings = recordings

    def __enter__(self) -> list:
        self.outer, self.records = getattr(self._recordings, "records", None), []
        self._recordings.records = self.records
        return self.records

    def __exit__(self, *exc) -> None:
        self._recordings.records = self.outer


class LaunchSequence:
    """The launches of one call, replayable with another call's tensors. `build` takes the records of the
    call, the call's own tensors (`slots`: what changes from call to call, e.g. q, k, v, out and the lists)
    and the addresses of the buffers the caller keeps (`owned`); every other tensor argument, and every
    descriptor's base, must be one of those buffers, whose addresses are then fixed in the sequence. The
    caller keeps the sequence with those buffers and keys it on everything its launches depend on besides
    the slots' addresses: shapes, strides, dtypes, alignment, integer and float arguments."""

    replayed_calls = 0  # over all sequences (tests check replays happen)

    def __init__(self, state: LaunchState, device: int, launches: list):
        self.state = state
        self.device = device
        self.generation = state.generation
        self.launches = launches  # (launcher, C function, grid, head, template, [(position, slot)])

    @classmethod
    def build(cls, state: LaunchState, records: list, slots: tuple, owned: set[int]) -> LaunchSequence | None:
        """The sequence of `records`, or None where one of its launches cannot be replayed."""
        if not records or any(record is None for record in records):
            return None
        present = [id(t) for t in slots if t is not None]
        if len(set(present)) < len(present):
            return None  # one tensor in two slots: which one a launch took is unknown (another call may differ)
        launches = []
        for launcher, entry, grid, all_args in records:
            template, places = [], []
            for i, value in enumerate(all_args):
                if i in entry.descriptors:
                    if value.base.data_ptr() not in owned:
                        return None
                    template.extend(entry.encoded(value, i))
                elif isinstance(value, torch.Tensor):
                    slot = next((j for j, t in enumerate(slots) if t is value), None)
                    if slot is not None:
                        places.append((len(template), slot))
                    elif value.data_ptr() not in owned:
                        return None  # a temporary of this call: its address is not the next call's
                    template.append(value.data_ptr())
                else:
                    template.append(value)
            launches.append((launcher, entry.launch, tuple(grid) + (1,) * (3 - len(grid)), entry.head, template,
                             places))
        return cls(state, driver.active.get_current_device(), launches)

    def replay(self, slots: tuple, stream: int | None = None) -> bool:
        """Launch the recorded kernels with `slots` in their places, on `stream` (the current device's
        current stream, which the caller may know already); False (nothing launched) where the sequence is
        stale: another current device, a launcher cleared, a profiler hook."""
        if self.generation != self.state.generation or any(hook is not None for hook in _launch_hooks()):
            return False  # a hook takes launch metadata, which a replay does not build
        device = driver.active.get_current_device()
        if device != self.device:
            return False
        if stream is None:
            stream = driver.active.get_current_stream(device)
        for launcher, launch, grid, head, template, places in self.launches:
            values = template.copy()
            for position, slot in places:
                values[position] = slots[slot].data_ptr()
            launch(*grid, stream, *head, None, None, None, *values)
            launcher.direct_launches += 1
            launcher.raw_launches += 1
        LaunchSequence.replayed_calls += 1
        return True


class LaunchSequences:
    """The launch sequences recorded into one set of buffers (whose addresses are `owned`), by the key of the call
    that recorded each: everything its launches depend on besides the addresses of the call's own tensors (the
    caller's promise, as a `CachedLauncher` key is). At most `limit`: all are dropped when one more comes. The
    caller keeps this with the buffers."""

    def __init__(self, state: LaunchState, owned: set[int], limit: int):
        self.state = state
        self.owned = owned
        self.limit = limit
        self._sequences: dict = {}

    def __len__(self) -> int:
        return len(self._sequences)

    def replay(self, key, slots: tuple, stream: int | None = None) -> bool:
        """Launch the sequence recorded for `key` with `slots` in their places (`LaunchSequence.replay`); False
        (nothing launched) where none was recorded or it declines."""
        sequence = self._sequences.get(key)
        return sequence is not None and sequence.replay(slots, stream)

    @contextmanager
    def recording(self, key, slots: tuple, replayable: bool = True):
        """`with sequences.recording(key, slots):` records the launches made in its scope and keeps their sequence
        for `key` (`LaunchSequence.build`), to replay for the next call of that key. None is kept (the next call
        records again) where a launch cannot be replayed, or where the caller says the sequence cannot be
        (`replayable` False)."""
        with self.state.recording() as records:
            yield
        if len(self._sequences) >= self.limit:
            self._sequences.clear()
        self._sequences[key] = LaunchSequence.build(self.state, records, slots, self.owned) if replayable else None


class CachedLauncher:
    """`launcher(key, grid, args, constexprs, **options)` runs `kernel[grid](*args, **constexprs, **options)`;
    `constexprs` in the kernel's parameter order after `args`. Only the first launch of a key binds and
    specializes; `key=None` always takes the full path, as does the Triton interpreter. A key's arguments
    keep their kinds: a tensor where the first launch had one, a descriptor where it had one."""

    def __init__(self, kernel, state: LaunchState):
        self.kernel = kernel
        self.state = state
        self._compiled: dict = {}
        self.direct_launches = 0  # launches that skipped the binding (tests check the cache is used)
        self.raw_launches = 0  # of those, launches through the C function (tests check it is taken)
        self._direct = True  # cleared if this triton's launcher does not take the call (the full path always works)
        self._raw = True  # cleared if the C function does not take the call (the Python launcher then does)

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> None:
        if key is not None and self._direct and knobs is not None and not interpreting():
            device = driver.active.get_current_device()
            key = (device, key, *constexprs.values(), *options.values())
            entry = self._compiled.get(key)
            if entry is not None:
                stream = driver.active.get_current_stream(device)
                all_args = (*args, *constexprs.values())
                enter, leave = _launch_hooks()
                compiled = entry.compiled
                metadata = compiled.launch_metadata(grid, stream, *all_args) if enter is not None else None
                grid_x, grid_y, grid_z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
                if entry.launch is not None and self._raw:
                    try:
                        entry.launch(grid_x, grid_y, grid_z, stream, *entry.head, metadata, enter, leave,
                                     *entry.arguments(all_args))
                        self.direct_launches += 1
                        self.raw_launches += 1
                        self.state.record((self, entry, grid, all_args))
                        return
                    except TypeError:  # it parses every argument before it launches anything
                        self._raw = False
                        self.state.invalidate_sequences()
                self.state.record(None)
                try:
                    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                                 metadata, enter, leave, *all_args)
                    self.direct_launches += 1
                    return
                except TypeError:  # the launcher parses its arguments before it launches anything
                    self._direct = False
                    self.clear()
                    self.kernel[grid](*args, **constexprs, **options)
                    return
            self.state.record(None)
            compiled = self.kernel[grid](*args, **constexprs, **options)
            names = getattr(self.kernel, "arg_names", None)
            # the direct call passes every parameter by position: only where the constexprs came in the
            # signature's order, after the positional ones, and where a compiled kernel came back
            if (compiled is not None and hasattr(compiled, "packed_metadata")
                    and names is not None and list(names) == [*names[:len(args)], *constexprs]):
                self._compiled[key] = _Entry(compiled, (*args, *constexprs.values()))
            return
        self.state.record(None)
        self.kernel[grid](*args, **constexprs, **options)

    def clear(self) -> None:
        """Forget the compiled kernels: each key's next launch is a full one (and no sequence replays)."""
        self._compiled.clear()
        self.state.invalidate_sequences()
