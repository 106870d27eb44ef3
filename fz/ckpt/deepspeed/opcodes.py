"""A pickle's opcodes interpreted into plain data: nothing it names runs unless a table allows it.

`parse` reads a pickle with `pickletools.genops` (which decodes opcodes, never runs them) and
builds the value on its own stack, so it decides what every opcode may do, where
`pickle.Unpickler` would look attributes up on whatever object is on its stack:
- ints, floats, strings, bytes, None, True/False, tuples, lists and dicts are built directly
  (a dict key must be a str, bytes, bool, None or an int below 2**61: keys whose hashes an
  attacker can make collide would cost quadratic time);
- a global is what `names(module, name)` maps it to (the caller refuses unknown names); REDUCE
  calls only a `Call`, NEWOBJ makes only a `Class`'s `DSObject`, whose state one BUILD sets;
  a persistent id goes to `storage`. Any other opcode (INST, OBJ, EXT*, sets, buffers...) is
  refused: so no opcode can change a storage or tensor once made, nor a table entry (BUILD of
  an OrderedDict, a state_dict's `_metadata`, is dropped unread).
At most MAX_OPS opcodes are read (time and memory: each can make a Python object of ~60
bytes). The value is then bounded by the pickle's own size: no cycles, at most MAX_DEPTH levels of
nesting, at most EXPANSION elements per pickle byte counting every shared reference each
time it is reached (a 600-byte pickle of lists that hold the one before twice stands for
2**30 elements, which any later walk of it would visit), and only data as leaves.
"""
from __future__ import annotations

import collections
import pickletools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 100  # levels of nesting: DeepSpeed's files nest about 6
MAX_OPS = 1 << 24  # opcodes: ~30 s and ~1 GB of Python objects at most; a tensor's record is ~20
EXPANSION = 4  # elements per pickle byte, shared references counted each time: DeepSpeed's files have 0.3
_SLACK = 1 << 12  # elements a tiny pickle may always hold
_MAX_KEY = 1 << 61  # int keys hash to themselves below this: no two collide
_DATA = (type(None), bool, int, float, str, bytes)

_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_VALUE = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING",
          "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES",
          "SHORT_BINBYTES", "BINBYTES8"}
_TUPLES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GET = {"GET", "BINGET", "LONG_BINGET"}


class Refused(ValueError):
    """A pickle that does something fz does not read: the message says what."""


@dataclass(frozen=True)
class Call:
    """A name REDUCE may call: `fn(*args)`, which checks its arguments."""

    fn: Callable[..., Any]


@dataclass(frozen=True)
class Class:
    """A class NEWOBJ may make: as a `DSObject` of its name, never an instance of it."""

    name: str


@dataclass(frozen=True)
class DSObject:
    """An instance of one of DeepSpeed's allowed classes, as plain data: its class name and state."""

    cls: str
    state: dict[str, Any] = field(default_factory=dict)


def _key(k: Any) -> Any:
    small = not isinstance(k, int) or -_MAX_KEY < k < _MAX_KEY
    if not isinstance(k, _DATA) or isinstance(k, float) or not small:
        raise Refused(f"a dict key of type {type(k).__name__} {str(k)[:40]!r} (fz reads str, bytes, bool, None and "
                      "small int keys)")
    return k


def _fill(d: dict, items: list[Any]) -> None:
    if len(items) % 2:
        raise Refused("SETITEMS of an odd number of items")
    for k, v in zip(items[::2], items[1::2]):
        d[_key(k)] = v


class _Machine:
    """The stack, marks and memo of one parse."""

    def __init__(self, names: Callable[[str, str], Any], storage: Callable[[Any], Any]):
        self.names, self.storage = names, storage
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.unbuilt: set[int] = set()  # DSObjects made by NEWOBJ and not yet given their state

    def pop(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise Refused("an opcode pops more than its stack holds")
        return self.stack.pop()

    def top(self, kind: type | tuple[type, ...], op: str) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0) or not isinstance(self.stack[-1], kind):
            got = f"a value of type {type(self.stack[-1]).__name__}" if self.stack else "an empty stack"
            raise Refused(f"{op} on {got}")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise Refused("a MARK is missing")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def step(self, name: str, arg: Any) -> None:
        s = self.stack
        if name in _VALUE:
            s.append(arg)
        elif name in _CONST:
            s.append(_CONST[name])
        elif name == "MARK":
            self.marks.append(len(s))
        elif name in _TUPLES:
            s.append(tuple(reversed([self.pop() for _ in range(_TUPLES[name])])))
        elif name == "TUPLE":
            s.append(tuple(self.pop_mark()))
        elif name == "EMPTY_LIST":
            s.append([])
        elif name == "LIST":
            s.append(self.pop_mark())
        elif name == "APPEND":
            v = self.pop()
            self.top(list, name).append(v)
        elif name == "APPENDS":
            items = self.pop_mark()
            self.top(list, name).extend(items)
        elif name == "EMPTY_DICT":
            s.append({})
        elif name == "DICT":
            d: dict = {}
            _fill(d, self.pop_mark())
            s.append(d)
        elif name == "SETITEM":
            v, k = self.pop(), self.pop()
            _fill(self.top(dict, name), [k, v])
        elif name == "SETITEMS":
            items = self.pop_mark()
            _fill(self.top(dict, name), items)
        elif name in _PUT:
            self.memo[len(self.memo) if arg is None else arg] = self.top(object, name)
        elif name in _GET:
            if arg not in self.memo:
                raise Refused(f"memo entry {arg} read before it is written")
            s.append(self.memo[arg])
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            s.append(self.top(object, name))
        else:
            self.call(name, arg)

    def call(self, name: str, arg: Any) -> None:
        """The opcodes that reach outside plain data: globals, calls, objects, persistent ids."""
        s = self.stack
        if name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            s.append(self.names(module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = self.pop(), self.pop()
            if not isinstance(module, str) or not isinstance(attr, str):
                raise Refused("STACK_GLOBAL of something other than two strings")
            s.append(self.names(module, attr))
        elif name == "REDUCE":
            args, fn = self.pop(), self.pop()
            if not isinstance(fn, Call) or not isinstance(args, tuple):
                raise Refused(f"a call of {type(fn).__name__}, which is not a function fz allows")
            s.append(fn.fn(*args))
        elif name == "NEWOBJ":
            args, cls = self.pop(), self.pop()
            if not isinstance(cls, Class) or args != ():
                raise Refused(f"NEWOBJ of {type(cls).__name__}, which is not a class fz reads as data")
            obj = DSObject(cls.name)
            self.unbuilt.add(id(obj))
            s.append(obj)
        elif name == "BUILD":
            state = self.pop()
            obj = self.top(object, name)
            if type(obj) is collections.OrderedDict and isinstance(state, dict):
                return  # a state_dict's attributes (`_metadata`, module versions): not read
            if not isinstance(obj, DSObject) or id(obj) not in self.unbuilt:
                raise Refused(f"a BUILD of {type(obj).__name__}, which takes no state (it would change an object "
                              "already made)")
            self.unbuilt.discard(id(obj))
            if isinstance(state, dict) and all(isinstance(k, str) for k in state):
                obj.state.update(state)
            else:
                obj.state["state"] = state
        elif name == "BINPERSID":
            s.append(self.storage(self.pop()))
        elif name == "PERSID":
            s.append(self.storage(arg))
        elif name not in ("PROTO", "FRAME"):
            raise Refused(f"opcode {name}, which no DeepSpeed checkpoint holds")


def parse(data: bytes, names: Callable[[str, str], Any], storage: Callable[[Any], Any],
          leaves: tuple[type, ...]) -> Any:
    """The value the pickle `data` describes, built as the module docstring says; `leaves`: the
    types besides plain data (and DSObjects) that the value may hold."""
    m = _Machine(names, storage)
    for n, (op, arg, _) in enumerate(pickletools.genops(data)):
        if n >= MAX_OPS:
            raise Refused(f"a pickle of more than {MAX_OPS} opcodes, which no checkpoint's metadata needs")
        if op.name == "STOP":
            value = m.pop()
            if m.stack or m.marks:
                raise Refused("values left on the stack at STOP")
            bound(value, EXPANSION * len(data) + _SLACK, _DATA + leaves)
            return value
        m.step(op.name, arg)
    raise Refused("no STOP opcode")


def _children(x: Any) -> Iterable[Any] | None:
    if isinstance(x, dict):
        return x.values()  # keys are plain data (_key)
    if isinstance(x, list | tuple):
        return x
    if isinstance(x, DSObject):
        return x.state.values()
    return None


def bound(root: Any, limit: int, leaves: tuple[type, ...]) -> None:
    """Refuse `root` if it holds a cycle, nests deeper than MAX_DEPTH, counts more than `limit`
    elements with every shared reference counted each time, or holds a leaf not in `leaves`.
    Iterative (no recursion) and linear in the distinct objects: each container is sized once."""
    sizes: dict[int, int] = {}  # id -> elements under a finished container
    kids = _children(root)
    if kids is None:
        if not isinstance(root, leaves):
            raise Refused(f"a {type(root).__name__} where fz reads only data")
        return
    path: list[list[Any]] = [[root, iter(kids), 1]]  # [container, its remaining children, elements so far]
    on_path = {id(root)}
    while path:
        top = path[-1]
        child = next(top[1], path)  # `path` itself: the end marker
        if child is path:
            path.pop()
            on_path.discard(id(top[0]))
            sizes[id(top[0])] = top[2]
            if path:
                path[-1][2] += top[2]
                if path[-1][2] > limit:
                    raise Refused(f"it stands for more than {limit} elements (shared references counted each "
                                  "time; the bound is its size): a pickle that expands when walked")
            continue
        grand = _children(child)
        if grand is None:
            if not isinstance(child, leaves):
                raise Refused(f"a {type(child).__name__} where fz reads only data")
            top[2] += 1
        elif id(child) in sizes:
            top[2] += sizes[id(child)]
        elif id(child) in on_path:
            raise Refused("a container that holds itself (a cycle)")
        elif len(path) >= MAX_DEPTH:
            raise Refused(f"it nests deeper than {MAX_DEPTH} levels")
        else:
            path.append([child, iter(grand), 1])
            on_path.add(id(child))
        if top[2] > limit:
            raise Refused(f"it stands for more than {limit} elements (shared references counted each time; the "
                          "bound is its size): a pickle that expands when walked")
