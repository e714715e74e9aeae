"""The one unpickler for the pickles a checkpoint holds: DCP's `.metadata` and each stored piece's
`data.pkl`. A checkpoint is data that anyone who can write to a pipeline's storage can change, so its
pickles may name only the globals a format needs, may set the state (the BUILD opcode) only of
instances of the types a format needs: never of a class or a function, whose attributes are the whole
process's (a BUILD on `pathlib.PosixPath` replaces `is_file` for every later caller; one on a function
rewrites its `__defaults__`), and never of a shared singleton (an Enum member). A pickle's memo can
also build a value that costs 2^n to hash or print from n small opcodes (`t = (t, t)`, n times): so a
dictionary key is a plain value or a type the format vouches for (`keys`), a call's arguments are
plain values, one level deep, and sets (hashed as they are built) are refused, as are the opcodes no
format here writes (extension codes, protocol 0's INST and OBJ).

Python's C unpickler calls `find_class` for globals but runs BUILD on whatever it is given, so this is
the pure-Python unpickler of the standard library with those opcodes replaced. torch's weights-only
unpickler refuses such a BUILD too, but allows every tensor-rebuilding global torch knows (a `.metadata`
needs none of them), and extends its allow-list only through a process-wide set (`safe_globals`),
which another thread's `torch.load` would see. Importing this module does not import torch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

ATOMS = (str, int, float, bool, type(None), bytes)
"""The plain values: cheap to hash and to print, whatever a pickle does."""


def plain_key(key: Any) -> bool:
    return type(key) in ATOMS


def _plain_args(args: Any) -> bool:
    """A call's arguments: plain values, and lists, tuples and empty dicts of plain values."""
    if type(args) is not tuple:
        return False
    for a in args:
        if type(a) in ATOMS:
            continue
        if type(a) in (list, tuple) and all(type(x) in ATOMS for x in a):
            continue
        if type(a) is dict and not a:
            continue
        return False
    return True


class RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the pure-Python one
    """`pickle.Unpickler` over the globals `allowed((module, name))` returns (None: refused), whose BUILD
    sets the state only of instances whose exact type is in `buildable`, whose dictionary keys pass
    `keys`, and whose calls (REDUCE, NEWOBJ) take plain arguments."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any, *, allowed: Callable[[tuple[str, str]], Any],
                 buildable: tuple[type, ...] = (), keys: Callable[[Any], bool] = plain_key,
                 what: str = "this file") -> None:
        super().__init__(file)
        self._file = file
        self._allowed, self._buildable, self._keys, self._what = allowed, buildable, keys, what

    def load(self) -> Any:
        """The standard library's loop, reading through the file's own methods (a BytesIO's: C) rather
        than its frame reader's Python ones, a call each opcode: a frame only delimits bytes that follow
        one another in the file anyway (about a third less time on a DCP `.metadata`)."""
        self.read, self.readline = self._file.read, self._file.readline
        self.readinto = self._file.readinto
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # STOP's way out of the loop
            return stop.value

    def load_frame(self) -> None:
        self.read(8)  # the frame's size: its bytes are read as they come

    def _refuse(self, why: str) -> None:
        raise pickle.UnpicklingError(f"{why}, which {self._what} never does")

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module[:80]}.{name[:80]} is not part of {self._what}")
        return found

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in self._buildable:  # exact: a class, a function or a singleton never is
            kind = "class" if isinstance(inst, type) else type(inst).__name__
            name = getattr(inst, "__name__", "?")
            self._refuse(f"sets the attributes of a {kind} ({name[:80] if type(name) is str else '?'})")
        setstate = getattr(type(inst), "__setstate__", None)  # the type's own, never one a state planted
        if setstate is not None:  # the format's own (DCP's TensorProperties)
            setstate(inst, state)
            return
        if isinstance(state, tuple) and len(state) == 2:
            state, slotstate = state
            if slotstate is not None:
                self._refuse("sets slot attributes")
        if state is None:
            return
        if not isinstance(state, Mapping):
            self._refuse(f"sets an object's state from a {type(state).__name__}")
        if any(type(k) is not str or k.startswith("__") for k in state):
            self._refuse("sets a special attribute")
        inst.__dict__.update(state)

    def load_reduce(self) -> None:
        if not _plain_args(self.stack[-1]):
            self._refuse("calls a global with other than plain arguments")
        super().load_reduce()

    def load_newobj(self) -> None:
        if not _plain_args(self.stack[-1]):
            self._refuse("makes an object from other than plain arguments")
        super().load_newobj()

    def load_setitem(self) -> None:
        if not self._keys(self.stack[-2]):
            self._refuse(f"keys a mapping by a {type(self.stack[-2]).__name__}")
        super().load_setitem()

    def load_setitems(self) -> None:
        for key in self.stack[::2]:  # the items since the MARK (a stack of their own): key, value, ...
            if not self._keys(key):
                self._refuse(f"keys a mapping by a {type(key).__name__}")
        super().load_setitems()

    def _unsupported(self) -> None:
        self._refuse("uses an opcode (a set, an extension code, INST or OBJ)")

    dispatch[pickle.FRAME[0]] = load_frame
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    for _op in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET, pickle.EXT1, pickle.EXT2, pickle.EXT4,
                pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX):
        dispatch[_op[0]] = _unsupported
    del _op
