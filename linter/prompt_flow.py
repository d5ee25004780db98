"""Following values into chat requests: the analysis behind the source rules (PS301-PS305).

A source finding names a **cause** (a call to ``datetime.now()``, a set iterated
in arbitrary order, ``json.dumps`` of a dict whose key order varies, a user's
data, a history slice) that **reaches** a part of a chat request whose bytes
should not change: the static prefix (system/developer text, tools, response
format) or the history. Values are followed through assignments, f-strings,
``.format``, ``%``, concatenation, ``str.join``, calls (arguments flow into the
result), function returns (also of functions used or registered as system
prompts, e.g. ``@agent.system_prompt`` or ``instructions=build_instructions``),
loops, module-level names (sets, dicts, constants), instance attributes
(``self.x = ...`` in any method is what ``self.x`` reads in every method of the
module), and the returns of functions imported from sibling modules
(``from .helpers import stamp``: that module is analysed too, one level deep, and
its cause is reported at the call that brings it into this module). A random
generator or a clock kept as a value (``self.rand = random.Random()``,
``self.clock = time.time``) makes every call of it, or of its methods, volatile;
``random.Random(42)`` (a constant seed) does not. ``sorted(...)`` removes an order cause; fixed-order literals
never have one. Each cause is reported once, at the cause, whatever number of
sinks it reaches.

Sinks (where a value enters a request):

* instructions: the ``content`` of a ``{"role": "system"|"developer"}`` dict,
  ``SystemMessage(...)``, keywords ``system``/``instructions``/``system_prompt``/
  ``system_message``/``preamble``, names such as ``system_prompt`` or
  ``INSTRUCTIONS``, and returns of system-prompt functions;
* tools: tool-definition dicts (``"type": "function"``, ``parameters``),
  ``tools``/``functions`` keywords and names, ``description`` keywords of tool
  constructors, ``response_format``;
* history (PS305 only): ``messages`` keywords and names, attributes such as
  ``self.history``, returns of functions named for messages or history and of
  ``get_items``-style methods of session/memory classes.

This is a lint, not a proof: values are not followed through parameters of
module functions, attributes are not told apart by class, and a branch's
assignment replaces the other branch's. It favours precision: a cause is only reported when a sink is
seen.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from linter import python_ast as pa

PS301, PS302, PS303, PS304, PS305 = "PS301", "PS302", "PS303", "PS304", "PS305"
ORDER_CODES = frozenset({PS302, PS303, PS305})

_INSTRUCTION_KEYWORDS = {"system", "instructions", "system_prompt", "system_message", "preamble", "developer_message"}
_TOOL_KEYWORDS = {"tools", "functions", "response_format", "text_format", "output_schema"}
_HISTORY_KEYWORDS = {"messages", "history", "chat_history", "input"}
_SYSTEM_CALLS = {"SystemMessage", "DeveloperMessage", "SystemMessagePromptTemplate", "SystemPromptPart"}
_INSTRUCTION_NAME = re.compile(r"(?i)^_*(system(_?prompt|_?message|_?instructions?)?|instructions?|preamble|developer_?(prompt|message))$|system_?prompt|instructions$")
_TOOLS_NAME = re.compile(r"(?i)^_*(tools|functions|tool_?specs?|tool_?schemas?|tool_?definitions?|response_format)$")
_HISTORY_NAME = re.compile(r"(?i)(^|_)(messages|msgs|history|transcript|turns)$")
_SEQUENCE_OF_TURNS = re.compile(r"(?i)(messages|msgs|history|turns|transcript|items|conversation|chat|memory|session|window|entries|events)$")
_HISTORY_FUNCTION = re.compile(r"(?i)(messages|history|transcript|context_window|window)")
_HISTORY_STORE = re.compile(r"(?i)^self\._?(messages|history|chat_history|chat_messages|transcript|turns|items)$")
_HISTORY_METHOD = re.compile(r"(?i)^(get|load|fetch|read)_?(items|messages|history|turns|entries|context)")
_SESSION_CLASS = re.compile(r"(?i)(session|memory|history|conversation|chat)")
_PROMPT_DECORATOR = re.compile(r"(?i)(system_prompt|instructions|system_message)$")
_USER_NAME = re.compile(r"(?i)^(current_|the_|my_|end_)?(user|customer|account|tenant|member|email|username)(_|s?$)")
_UNORDERED_CALLS = {"set", "frozenset", "os.listdir", "listdir", "glob.glob", "glob.iglob", "os.scandir", "scandir"}
_UNORDERED_METHODS = {"iterdir", "glob", "rglob", "union", "intersection", "difference", "symmetric_difference"}
_EXECUTORS = {"to_thread", "run_in_executor", "run_sync"}
_ORDER_FREE = {"len", "sorted", "min", "max", "sum", "any", "all", "isinstance", "bool", "hash", "id", "type", "callable"}
_GENERATORS = {"random.Random", "Random", "random.SystemRandom", "SystemRandom", "secrets.SystemRandom",
               "numpy.random.default_rng", "np.random.default_rng", "default_rng"}
_RANDOM = {"random.random", "random.randint", "random.choice", "random.choices", "random.sample", "random.shuffle", "random.uniform", "random.randrange", "random.getrandbits"}


@dataclass(frozen=True)
class Cause:
    """A reason the bytes of a request can change: ``code`` reported at ``node`` with ``what``."""

    code: str
    line: int
    column: int
    what: str
    edit: bool = False  # an in-place edit (del, pop, insert, remove) rather than a slice


@dataclass(frozen=True)
class Flow:
    """What a value carries: causes, and whether it is an unordered collection (set) or a dict with varying key order."""

    causes: frozenset[Cause] = frozenset()
    unordered: Cause | None = None  # iterating it puts elements in arbitrary order (PS303 at the iteration)
    varying_keys: ast.AST | None = None  # a dict whose key order varies (PS302 at an unsorted json.dumps)
    factory: str | None = None  # a random generator or a clock: calling it or its methods is volatile (PS301)

    def __or__(self, other: Flow) -> Flow:
        return Flow(self.causes | other.causes, self.unordered or other.unordered, self.varying_keys or other.varying_keys,
                    self.factory or other.factory)


CLEAN = Flow()


@dataclass(frozen=True)
class Reach:
    """A cause and the first kind of sink it reaches: ``instructions``, ``tools`` or ``history``."""

    cause: Cause
    sink: str

    @property
    def sink_text(self) -> str:
        return {"instructions": "system prompt", "tools": "tools", "history": "messages"}[self.sink]


def _cause(code: str, node: ast.AST, what: str, *, edit: bool = False) -> Cause:
    return Cause(code, getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1, what, edit)


def _iterated(flow: Flow, at: ast.AST) -> Flow:
    """The value of iterating ``flow`` (in a comprehension, list(), join, a loop): an order cause if unordered."""
    causes = flow.causes
    if flow.unordered is not None:
        causes = causes | {_cause(PS303, at, flow.unordered.what)}
    elif flow.varying_keys is not None:
        causes = causes | {_cause(PS303, at, "a dict whose key order varies")}
    return Flow(causes)


def _text(flow: Flow) -> Flow:
    """A value written into text: a window of the history becomes content, not the history (no PS305)."""
    return Flow(frozenset(c for c in flow.causes if c.code != PS305))


def _sorted(flow: Flow) -> Flow:
    return Flow(frozenset(c for c in flow.causes if c.code not in (PS302, PS303)))


def _sort_keys(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "sort_keys":
            return not (isinstance(keyword.value, ast.Constant) and not keyword.value.value)
        if keyword.arg is None:
            return True
    return False


class _Module:
    """The analysis of one module: function returns to a fixpoint, then sinks (see the module docstring)."""

    def __init__(self, tree: ast.Module, path: str | None = None, depth: int = 0) -> None:
        self.tree = tree
        self.path = path
        self.depth = depth
        self.attributes: dict[str, Flow] = {}  # "self.x" -> what any method assigns to it
        self.imported = _imported_functions(tree, path) if depth == 0 else {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.owner: dict[ast.AST, str] = {}  # function -> enclosing class name
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.owner[child] = node.name
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, []).append(node)
        self.returns: dict[str, Flow] = {}
        self.prompt_functions = self._prompt_functions()
        self.module_env: dict[str, Flow] = {}
        self.found: dict[tuple[str, int, int], Reach] = {}
        self.reporting = False

    def _prompt_functions(self) -> set[str]:
        """Functions whose return value is instructions: by decorator, by name, or passed as instructions."""
        names: set[str] = set()
        for name, defs in self.functions.items():
            for fn in defs:
                decorators = [pa.dotted_name(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list]
                if any(_PROMPT_DECORATOR.search(d.split(".")[-1]) for d in decorators if d) or _INSTRUCTION_NAME.search(name):
                    names.add(name)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.keyword) and node.arg in _INSTRUCTION_KEYWORDS:
                ref = pa.dotted_name(node.value).split(".")[-1]
                if ref in self.functions and isinstance(node.value, ast.Name | ast.Attribute):
                    names.add(ref)
        return names

    # -- evaluation ---------------------------------------------------------------------------

    def flow(self, node: ast.AST | None, env: dict[str, Flow]) -> Flow:
        if node is None:
            return CLEAN
        method = getattr(self, "_flow_" + type(node).__name__, None)
        if method is not None:
            result: Flow = method(node, env)
            return result
        out = CLEAN
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                out = out | self.flow(child, env)
        return out

    def _lookup(self, name: str, env: dict[str, Flow]) -> Flow:
        if name in env:
            return env[name]
        if name in self.module_env:
            return self.module_env[name]
        return self.attributes.get(name, CLEAN)

    def _flow_Name(self, node: ast.Name, env: dict[str, Flow]) -> Flow:
        if node.id not in env and _is_clock(node):
            return Flow(factory=node.id)
        if node.id in self.functions and node.id not in env and node.id not in self.module_env:
            # A function passed as a value (a tool, a callback) is not its result; system-prompt
            # callbacks are sinks themselves (their returns are checked as instructions).
            return CLEAN
        return self._lookup(node.id, env) | _user_value(node)

    def _flow_Attribute(self, node: ast.Attribute, env: dict[str, Flow]) -> Flow:
        name = pa.dotted_name(node)
        if _is_user_name(name):
            return self._lookup(name, env) | _user_value(node)
        if name in env or name in self.module_env or name in self.attributes:
            return self._lookup(name, env)
        if _is_clock(node):
            return Flow(factory=name)
        if node.attr in self.functions and name.split(".")[0] in ("self", "cls"):
            return CLEAN  # a method passed as a value, see _flow_Name
        return self.flow(node.value, env)

    def _flow_Set(self, node: ast.AST, env: dict[str, Flow]) -> Flow:
        inner = CLEAN
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                inner = inner | self.flow(child, env)
        return Flow(inner.causes, _cause(PS303, node, "a set"))

    _flow_SetComp = _flow_Set

    def _flow_Subscript(self, node: ast.Subscript, env: dict[str, Flow]) -> Flow:
        base = self.flow(node.value, env)
        if isinstance(node.slice, ast.Slice):
            lower = node.slice.lower
            sliding = _window_start(lower) and bool(_SEQUENCE_OF_TURNS.search(pa.dotted_name(node.value)))
            if sliding:
                text = ast.unparse(node)
                return Flow(base.causes | {_cause(PS305, node, f"{text} keeps a sliding window")}, base.unordered)
            return base
        return Flow((base | self.flow(node.slice, env)).causes)

    def _flow_Compare(self, node: ast.Compare, env: dict[str, Flow]) -> Flow:
        out = self.flow(node.left, env)
        for comparator in node.comparators:
            out = out | self.flow(comparator, env)
        return Flow(frozenset(c for c in out.causes if c.code not in ORDER_CODES))

    def _flow_JoinedStr(self, node: ast.JoinedStr, env: dict[str, Flow]) -> Flow:
        out = CLEAN
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                out = out | _iterated(self.flow(value.value, env), value.value)
        return _text(out)

    def _flow_BinOp(self, node: ast.BinOp, env: dict[str, Flow]) -> Flow:
        left, right = self.flow(node.left, env), self.flow(node.right, env)
        if isinstance(node.op, ast.BitOr | ast.BitAnd | ast.Sub | ast.BitXor) and (left.unordered or right.unordered):
            return Flow(left.causes | right.causes, left.unordered or right.unordered)
        if isinstance(node.op, ast.Mod):
            right = _iterated(right, node.right) if right.unordered else right
            return _text(left | right)
        return Flow((left | right).causes)

    def _comprehension(self, node: ast.ListComp | ast.GeneratorExp | ast.DictComp, env: dict[str, Flow]) -> tuple[Flow, Flow]:
        """(causes of the elements, the flow of iterating the generators)."""
        local = dict(env)
        order = CLEAN
        for generator in node.generators:
            source = self.flow(generator.iter, local)
            order = order | _iterated(source, generator.iter)
            for name in pa.assigned_names(ast.Assign(targets=[generator.target], value=generator.iter)):
                local[name] = Flow(source.causes)
        if isinstance(node, ast.DictComp):
            elements = self.flow(node.key, local) | self.flow(node.value, local)
        else:
            elements = self.flow(node.elt, local)
        return Flow(elements.causes), order

    def _flow_ListComp(self, node: ast.ListComp | ast.GeneratorExp, env: dict[str, Flow]) -> Flow:
        elements, order = self._comprehension(node, env)
        return elements | order

    _flow_GeneratorExp = _flow_ListComp

    def _flow_DictComp(self, node: ast.DictComp, env: dict[str, Flow]) -> Flow:
        elements, order = self._comprehension(node, env)
        varying = node if order.causes - elements.causes else None
        return Flow(elements.causes | frozenset(c for c in order.causes if c.code != PS303), None, varying)

    def _flow_Call(self, node: ast.Call, env: dict[str, Flow]) -> Flow:
        name = pa.call_name(node)
        last = name.split(".")[-1]
        args = [*node.args, *(k.value for k in node.keywords)]
        if pa.is_volatile_call(node) or name in _RANDOM or (last in ("now", "utcnow", "today") and "date" in name.lower()):
            return Flow(frozenset({_cause(PS301, node, name + "()")}))
        if name in _GENERATORS:  # a generator seeded by the OS, unless the seed is a constant
            seeded = bool(args) and all(isinstance(a, ast.Constant) and a.value is not None for a in args)
            return CLEAN if seeded else Flow(factory=name + "()")
        called = self.flow(node.func, env) if isinstance(node.func, ast.Name | ast.Attribute) else CLEAN
        receiver = self.flow(node.func.value, env) if isinstance(node.func, ast.Attribute) else CLEAN
        if called.factory or receiver.factory:  # self.clock(), self.rand.randint(...)
            return Flow(frozenset({_cause(PS301, node, f"{name}() (from {called.factory or receiver.factory})")}))
        if isinstance(node.func, ast.Name) and node.func.id in self.imported and node.func.id not in self.functions:
            return self._imported_result(node, env, args)
        if name in ("sorted",):
            return _sorted(self._args(args, env))
        if name in _UNORDERED_CALLS or last in ("listdir", "scandir"):
            inner = self._args(args, env)
            return Flow(inner.causes, _cause(PS303, node, f"{name}(...)"))
        if isinstance(node.func, ast.Attribute) and last in _UNORDERED_METHODS:
            receiver = self.flow(node.func.value, env)
            if last in ("iterdir", "glob", "rglob") or receiver.unordered:
                return Flow((receiver | self._args(args, env)).causes, receiver.unordered or _cause(PS303, node, f".{last}(...)"))
        if last in ("dumps", "dump") and "json" in name:
            value = self.flow(node.args[0], env) if node.args else CLEAN
            if value.varying_keys is not None and not _sort_keys(node):
                return Flow(value.causes | {_cause(PS302, node, "json.dumps of a dict whose key order varies")})
            return _iterated(Flow(value.causes, value.unordered), node.args[0]) if node.args else CLEAN
        if name in ("dict.fromkeys", "dict") and args:
            first = self.flow(args[0], env)
            if first.unordered is not None:
                return Flow(first.causes, None, node)
        if name in _ORDER_FREE:
            return Flow(frozenset(c for c in self._args(args, env).causes if c.code not in ORDER_CODES))
        if name in ("list", "tuple", "str", "enumerate", "reversed", "repr") or last == "join":
            flows = [_iterated(self.flow(a, env), a) for a in args]
            receiver = self.flow(node.func.value, env) if isinstance(node.func, ast.Attribute) else CLEAN
            out = Flow(receiver.causes)
            for f in flows:
                out = out | f
            return _text(out) if name in ("str", "repr") or last == "join" else out
        out = CLEAN
        if name in self.functions or (isinstance(node.func, ast.Attribute) and last in self.functions and name.split(".")[0] in ("self", "cls")):
            out = self.returns.get(last, CLEAN)
        elif isinstance(node.func, ast.Attribute):
            # A method of a value carries the value's causes; a list's window survives only a copy.
            causes = self.flow(node.func.value, env).causes
            out = Flow(causes if last == "copy" else frozenset(c for c in causes if c.code != PS305))
        arguments = Flow(self._args(args, env).causes)
        if last in ("format", "format_map", "substitute", "safe_substitute"):
            return out | _text(arguments)
        if last in _EXECUTORS:  # asyncio.to_thread(fetch): the result is fetch's
            out = out | self._function_results(args)
        # Other calls carry their arguments' causes, but not user data: a tool factory
        # given a customer directory is one tool for everyone; string building above keeps it.
        return out | Flow(frozenset(c for c in arguments.causes if c.code != PS304))

    def _imported_result(self, node: ast.Call, env: dict[str, Flow], args: list[ast.expr]) -> Flow:
        """A helper from a sibling module: its return's causes, reported at this call."""
        assert isinstance(node.func, ast.Name)
        source, function = self.imported[node.func.id]
        returned = _module_returns(source).get(function, CLEAN)
        causes = {_cause(c.code, node, f"{node.func.id}() ({Path(source).name}:{c.line}: {c.what})")
                  for c in returned.causes if c.code in (PS301, PS302, PS303)}
        unordered = _cause(PS303, node, f"{node.func.id}() ({returned.unordered.what})") if returned.unordered else None
        return Flow(frozenset(causes), unordered) | Flow(frozenset(
            c for c in self._args(args, env).causes if c.code != PS304))

    def _function_results(self, args: list[ast.expr]) -> Flow:
        out = CLEAN
        for arg in args:
            name = pa.dotted_name(arg).split(".")[-1] if isinstance(arg, ast.Name | ast.Attribute) else ""
            if name in self.functions:
                out = out | self.returns.get(name, CLEAN)
        return out

    def _args(self, args: list[ast.expr], env: dict[str, Flow]) -> Flow:
        out = CLEAN
        for arg in args:
            out = out | self.flow(arg, env)
        return out

    # -- statements -------------------------------------------------------------------------

    def run(self) -> list[Reach]:
        for _ in range(3):  # module names and function returns to a fixpoint
            before = (dict(self.returns), dict(self.module_env), dict(self.attributes))
            self._body(self.tree.body, self.module_env, None)
            for defs in self.functions.values():
                for fn in defs:
                    self._function(fn)
            if (dict(self.returns), dict(self.module_env), dict(self.attributes)) == before:
                break
        self.reporting = True
        self._body(self.tree.body, self.module_env, None)
        for defs in self.functions.values():
            for fn in defs:
                self._function(fn)
        return sorted(self.found.values(), key=lambda r: (r.cause.line, r.cause.column, r.cause.code))

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        env: dict[str, Flow] = {}
        for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            if _is_set_annotation(arg.annotation):
                env[arg.arg] = Flow(unordered=_cause(PS303, arg, f"the set {arg.arg!r}"))
        self._body(fn.body, env, fn)

    def _body(self, body: list[ast.stmt], env: dict[str, Flow], fn: ast.FunctionDef | ast.AsyncFunctionDef | None, loop: Flow = CLEAN) -> None:
        for statement in body:
            self._statement(statement, env, fn, loop)

    def _statement(self, node: ast.stmt, env: dict[str, Flow], fn: ast.FunctionDef | ast.AsyncFunctionDef | None, loop: Flow) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            self._sinks(node, env, fn)  # decorators, e.g. @agent.tool(description=...)
            if isinstance(node, ast.ClassDef):
                self._body(node.body, dict(env), None)  # class attributes: sinks by name
            return
        self._sinks(node, env, fn)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            value = self.flow(node.value, env) if node.value is not None else CLEAN
            if isinstance(node, ast.AnnAssign) and _is_set_annotation(node.annotation) and value.unordered is None:
                value = Flow(value.causes, _cause(PS303, node.target, "a set"))
            for name in pa.assigned_names(node):
                if isinstance(node, ast.AugAssign):
                    value = self._lookup(name, env) | value | loop
                env[name] = value
                if fn is not None and name.startswith("self.") and name.count(".") == 1:
                    self.attributes[name] = self.attributes.get(name, CLEAN) | value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript):  # d["k"]["j"] = v: the container now holds v
                    root: ast.expr = target
                    while isinstance(root, ast.Subscript):
                        root = root.value
                    base = pa.dotted_name(root)
                    if base:
                        env[base] = self._lookup(base, env) | Flow(value.causes) | loop
        elif isinstance(node, ast.For | ast.AsyncFor):
            source = self.flow(node.iter, env)
            order = _iterated(source, node.iter) if (source.unordered or source.varying_keys) else CLEAN
            for name in pa.assigned_names(ast.Assign(targets=[node.target], value=node.iter)):
                env[name] = Flow(source.causes)
            for _ in range(2):
                self._body(node.body, env, fn, loop | order)
            self._body(node.orelse, env, fn, loop)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self._mutation(node.value, env, loop)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Subscript):
                    self._edit(pa.dotted_name(target.value), target, env, f"del {ast.unparse(target)} edits the history")
        elif isinstance(node, ast.Return):
            if fn is not None:
                self.returns[fn.name] = self.returns.get(fn.name, CLEAN) | self.flow(node.value, env)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    for child in children:
                        if isinstance(child, ast.ExceptHandler):
                            self._body(child.body, env, fn, loop)
                        elif isinstance(child, ast.stmt):
                            self._statement(child, env, fn, loop)
            if isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if item.optional_vars is not None:
                        for name in pa.assigned_names(ast.Assign(targets=[item.optional_vars], value=item.context_expr)):
                            env[name] = Flow(self.flow(item.context_expr, env).causes)

    def _mutation(self, call: ast.Call, env: dict[str, Flow], loop: Flow) -> None:
        if not isinstance(call.func, ast.Attribute):
            return
        target = pa.dotted_name(call.func.value)
        method = call.func.attr
        if not target:
            return
        if method in ("append", "extend", "update", "add", "insert", "appendleft"):
            added = Flow(self._args([*call.args], env).causes) | loop
            env[target] = self._lookup(target, env) | added
            kind = _named_sink(target)
            if kind is not None:
                self._report(added, kind)
        list_pop = method == "pop" and len(call.args) == 1 and not _minus_one(call.args[0]) and _is_int(call.args[0])
        if method == "remove" or list_pop:
            self._edit(target, call, env, f"{ast.unparse(call.func)}(...) edits the history")
        if method == "shuffle" and pa.call_name(call).startswith("random"):
            for arg in call.args:
                name = pa.dotted_name(arg)
                if name:
                    env[name] = self._lookup(name, env) | Flow(frozenset({_cause(PS301, call, "random.shuffle()")}))

    def _edit(self, target: str, node: ast.AST, env: dict[str, Flow], what: str) -> None:
        if not _HISTORY_NAME.search(target.split(".")[-1]):
            return
        cause = _cause(PS305, node, what, edit=True)
        env[target] = self._lookup(target, env) | Flow(frozenset({cause}))
        if _HISTORY_STORE.match(target):  # the object's own history: what it sends next
            self._report(Flow(frozenset({cause})), "history")

    # -- sinks ----------------------------------------------------------------------------------

    def _report(self, flow: Flow, kind: str) -> None:
        if not self.reporting:
            return
        returned = kind == "returned history"
        kind = "history" if returned else kind
        for cause in flow.causes:
            if returned and cause.edit:
                continue  # a function that computes a history with an insert is not one that sends it edited
            if (kind == "history") == (cause.code == PS305):
                if cause.code == PS304 and kind != "tools":
                    continue
                self.found.setdefault((cause.code, cause.line, cause.column), Reach(cause, kind))

    def _sinks(self, statement: ast.stmt, env: dict[str, Flow], fn: ast.FunctionDef | ast.AsyncFunctionDef | None) -> None:
        if not self.reporting:
            return
        for kind, expr in self._sink_exprs(statement, fn):
            flow = self.flow(expr, env)
            if kind == "tools":
                flow = flow | self._user_data(expr, env)
            self._report(flow, kind)

    def _user_data(self, expr: ast.expr, env: dict[str, Flow]) -> Flow:
        """User-specific names read inside a tool definition (PS304), the outermost of each attribute chain."""
        causes: set[Cause] = set()
        stack: list[ast.AST] = [expr]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                name = pa.dotted_name(node)
                if name.split(".")[-1] in self.functions:
                    continue  # a tool function listed in the tools
                if _is_user_name(name):
                    causes.add(_cause(PS304, node, f"{name!r} (user-specific)"))
                    continue
            if isinstance(node, ast.Call):
                stack.extend([*node.args, *(k.value for k in node.keywords)])  # not the callee: user.get_x is a call on user data
                if isinstance(node.func, ast.Attribute):
                    stack.append(node.func.value)
                continue
            stack.extend(ast.iter_child_nodes(node))
        return Flow(frozenset(causes))

    def _sink_exprs(self, statement: ast.stmt, fn: ast.FunctionDef | ast.AsyncFunctionDef | None) -> Iterator[tuple[str, ast.expr]]:
        if isinstance(statement, ast.Return) and statement.value is not None and fn is not None:
            if fn.name in self.prompt_functions:
                yield "instructions", statement.value
            if _HISTORY_FUNCTION.search(fn.name) or (_SESSION_CLASS.search(self.owner.get(fn, "")) and _HISTORY_METHOD.search(fn.name)):
                yield "returned history", statement.value
        if isinstance(statement, ast.Assign | ast.AnnAssign) and statement.value is not None:
            for name in pa.assigned_names(statement):
                kind = _named_sink(name)
                if kind is not None:
                    yield kind, statement.value
        for node in _walk_statement(statement):
            if isinstance(node, ast.Dict):
                role = pa.string_value(pa.dict_get(node, "role"))
                content = pa.dict_get(node, "content")
                if role in ("system", "developer") and content is not None:
                    yield "instructions", content
                if _is_tool_dict(node):
                    yield "tools", node
            elif isinstance(node, ast.Call):
                name = pa.call_name(node).split(".")[-1]
                if name in _SYSTEM_CALLS:
                    yield from (("instructions", a) for a in node.args[:1])
                for keyword in node.keywords:
                    if keyword.arg in _INSTRUCTION_KEYWORDS or (keyword.arg == "content" and name in _SYSTEM_CALLS):
                        yield "instructions", keyword.value
                    elif keyword.arg in _TOOL_KEYWORDS or (keyword.arg == "description" and re.search(r"(?i)tool|function", name)):
                        yield "tools", keyword.value
                    elif keyword.arg in _HISTORY_KEYWORDS:
                        yield "history", keyword.value


def _is_user_name(name: str) -> bool:
    """``user``, ``account_id``, ``self.customer.name`` (by the root, past ``self``); not ``tool.user_location`` or CONSTANTS."""
    parts = name.split(".")
    if parts[0] in ("self", "cls") and len(parts) > 1:
        parts = parts[1:]
    root = parts[0].lstrip("_")
    return bool(root) and not root.isupper() and bool(_USER_NAME.search(root))


def _user_value(node: ast.Name | ast.Attribute) -> Flow:
    """A read of user-specific data (``user.name``, ``account_id``): a PS304 cause, reported only in tool definitions."""
    name = pa.dotted_name(node)
    if not _is_user_name(name):
        return CLEAN
    return Flow(frozenset({_cause(PS304, node, f"{name!r} (user-specific)")}))


def _named_sink(name: str) -> str | None:
    """The sink a variable or attribute name stands for (``system_prompt``, ``tools``, ``self.messages``), or None."""
    last = name.split(".")[-1]
    if _INSTRUCTION_NAME.search(last):
        return "instructions"
    if _TOOLS_NAME.search(last):
        return "tools"
    if _HISTORY_NAME.search(last):
        return "history"
    return None


def _walk_statement(statement: ast.stmt) -> Iterator[ast.AST]:
    """The nodes of a simple statement (compound statements' bodies are visited as statements)."""
    stack: list[ast.AST] = [statement]
    while stack:
        node = stack.pop()
        yield node
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse", "finalbody", "handlers"):
                continue
            children = value if isinstance(value, list) else [value]
            stack.extend(c for c in children if isinstance(c, ast.AST) and not isinstance(c, ast.Lambda))


def _is_tool_dict(node: ast.Dict) -> bool:
    keys = {pa.string_value(k) for k in node.keys if k is not None}
    if "id" in keys or "call_id" in keys:  # a tool *call* ({"id", "type": "function", "function": ...}), not a definition
        return False
    return pa.string_value(pa.dict_get(node, "type")) == "function" or ("parameters" in keys and ("name" in keys or "description" in keys))


def _is_set_annotation(node: ast.expr | None) -> bool:
    if node is None:
        return False
    base = node.value if isinstance(node, ast.Subscript) else node
    return pa.dotted_name(base).split(".")[-1] in ("set", "frozenset", "Set", "FrozenSet", "AbstractSet", "MutableSet")


def _window_start(lower: ast.expr | None) -> bool:
    """A slice start that keeps the last N items: ``-10``, ``-limit``, ``len(x) - n`` (not ``-1``: the last item)."""
    if isinstance(lower, ast.UnaryOp) and isinstance(lower.op, ast.USub):
        return not (isinstance(lower.operand, ast.Constant) and lower.operand.value == 1)
    if isinstance(lower, ast.Constant) and isinstance(lower.value, int):
        return lower.value < -1
    return (
        isinstance(lower, ast.BinOp)
        and isinstance(lower.op, ast.Sub)
        and isinstance(lower.left, ast.Call)
        and pa.call_name(lower.left) == "len"
    )


def _minus_one(node: ast.expr) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) and node.operand.value == 1


def _is_int(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    return isinstance(node, ast.Name | ast.BinOp | ast.UnaryOp)


@lru_cache(maxsize=8)
def analyze(tree: ast.Module, path: str | None = None) -> tuple[Reach, ...]:
    """Every cause in ``tree`` that reaches a sink, once each, in source order (memoized per tree).

    ``path`` (the module's file) lets imports from sibling modules be followed."""
    return tuple(_Module(tree, path).run())


def reaches(tree: ast.Module, code: str, path: str | None = None) -> Iterator[Reach]:
    """The causes of rule ``code`` in ``tree`` (the file ``path``) that reach a sink."""
    return (r for r in analyze(tree, path) if r.cause.code == code)


def _is_clock(node: ast.Name | ast.Attribute) -> bool:
    """A volatile function named as a value (``time.time``, ``datetime.now``), not called."""
    return pa.is_volatile_call(ast.Call(func=node, args=[], keywords=[]))


def _imported_functions(tree: ast.Module, path: str | None) -> dict[str, tuple[str, str]]:
    """Local name -> (file, function) for ``from .mod import f`` / ``from pkg.mod import f``
    whose module is a file next to ``path`` (or in a package above it)."""
    if path is None:
        return {}
    here = Path(path).resolve().parent
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        parts = node.module.split(".")
        bases = [here.parents[node.level - 2] if node.level > 1 else here] if node.level else [here, *here.parents[:2]]
        for base in bases:
            candidate = base.joinpath(*parts).with_suffix(".py")
            if candidate.is_file() and candidate != Path(path).resolve():
                for alias in node.names:
                    found[alias.asname or alias.name] = (str(candidate), alias.name)
                break
    return found


@lru_cache(maxsize=64)
def _module_returns(path: str) -> dict[str, Flow]:
    """The function returns of the module in file ``path`` (not following its own imports)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    module = _Module(tree, path, depth=1)
    module.run()
    return module.returns
