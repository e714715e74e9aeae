"""The one unpickler for the pickles a checkpoint holds: DCP's `.metadata` and each stored piece's
`data.pkl`. A checkpoint is data that anyone who can write to a pipeline's storage can change, so its
pickles may name only the globals a format needs, and may set the state (the BUILD opcode) only of
instances of the types a format needs: never of a class or a function, whose attributes are the whole
process's (a BUILD on `pathlib.PosixPath` replaces `is_file` for every later caller; one on a function
rewrites its `__defaults__`).

Python's C unpickler calls `find_class` for globals but runs BUILD on whatever it is given, so this is
the pure-Python unpickler of the standard library with its BUILD replaced. torch's weights-only
unpickler refuses such a BUILD too, but allows every tensor-rebuilding global torch knows (a `.metadata`
needs none of them), and extends its allow-list only through a process-wide set (`safe_globals`),
which another thread's `torch.load` would see. Importing this module does not import torch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


class RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the pure-Python one
    """`pickle.Unpickler` over the globals `allowed((module, name))` returns (None: refused), whose BUILD
    sets the state only of instances whose exact type is in `buildable`."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any, *, allowed: Callable[[tuple[str, str]], Any],
                 buildable: tuple[type, ...] = (), what: str = "this file") -> None:
        super().__init__(file)
        self._allowed, self._buildable, self._what = allowed, buildable, what

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of {self._what}")
        return found

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in self._buildable:  # exact: a class or a function is never an instance here
            kind = "class" if isinstance(inst, type) else type(inst).__name__
            raise pickle.UnpicklingError(f"sets the attributes of a {kind} ({getattr(inst, '__name__', '?')}),"
                                         f" which {self._what} never does")
        setstate = getattr(inst, "__setstate__", None)
        if setstate is not None:  # the format's own (DCP's TensorProperties)
            setstate(state)
            return
        slotstate = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slotstate = state
        for part in (state, slotstate):
            if part is not None and not isinstance(part, Mapping):
                raise pickle.UnpicklingError(f"an object state of type {type(part).__name__} in {self._what}")
        if state:
            inst.__dict__.update({str(k): v for k, v in state.items()})
        for k, v in (slotstate or {}).items():
            setattr(inst, str(k), v)

    dispatch[pickle.BUILD[0]] = load_build
