"""What a model's own code calls on its layers, read from the source of its classes.

Everything that acts around a layer's forward does so through forward hooks, which ``__call__`` runs: FSDP2
gathers a stage-3 unit's parameters in them, and activation checkpointing starts and ends its recomputation region
in them. A layer whose parent calls it otherwise escapes them: Gemma-3n's decoder layer calls its AltUp's
``predict`` and ``correct``, a training step the ``encode`` and ``decode`` of an autoencoder, and SqueezeBERT's
encoder runs its layers as ``layer.forward(...)``. Such a layer cannot be a unit of its own (its parameters would
be shards when it computes), and checkpointing it keeps its activations. Nor can a layer whose parameters the code
holding it computes with (a tied head ``F.linear(h, self.embed.weight)``). The source is read once per function that
names what is looked for, in a class and those it inherits from (torch's left out); a function whose source cannot
be read calls nothing.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterator

from torch import nn

#: Modules without a forward of their own: their elements are what their holder calls.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def methods_called_by(parent: nn.Module, name: str, child: nn.Module) -> list[str]:
    """Methods of ``child`` (other than ``forward``) that ``parent``'s own code calls as ``self.<name>.<method>(`` and
    that reach ``child``'s own parameters or layers by name: Gemma-3n's AltUp, whose decoder layer calls its
    ``predict``, which reads ``self.prediction_coefs``; an autoencoder's ``encode``. A method that runs the module
    through ``self(...)`` (Hugging Face's ``generate``) or touches none of it (``save_pretrained``) passes through
    the hooks or needs none."""
    called = frozenset().union(*(_attribute_calls(cls, name) for cls in _model_classes(type(parent))))
    if not called:
        return []
    # Methods a class of the model's own defines (the most derived definition): torch's (``.to(...)``,
    # ``.reset_parameters()``) gather nothing.
    methods: dict[str, types.FunctionType] = {}
    for cls in _model_classes(type(child)):
        for method, value in vars(cls).items():
            if method in called and method != "forward" and inspect.isfunction(function := _function(value)):
                methods.setdefault(method, function)
    own = {n for n, _ in child.named_parameters(recurse=False)} | {n for n, _ in child.named_children()}
    return sorted(method for method, function in methods.items() if _code_names(function.__code__) & own)


def bypassing_hooks(root: nn.Module) -> dict[int, str]:
    """The modules under ``root`` that their holder's code runs other than through ``__call__`` (which runs the
    forward hooks), by ``id``, each with its name: their ``forward`` called directly (:func:`_direct_forwards`:
    ``self.<name>.forward(...)``, ``self.<name>[i].forward(...)``, ``layer.forward(...)`` in a loop over
    ``self.<name>`` or after ``layer = self.<name>[i]``, ``getattr(self, f"layer_{i}").forward(...)``, also further
    down, as ``self.<a>.<b>.forward(...)``: for an ``nn.ModuleList`` or ``nn.ModuleDict``, each of its elements),
    or another method of theirs (:func:`methods_called_by`: an autoencoder's ``self.vae.encode(x)``)."""
    found: dict[int, str] = {}
    for holder_name, holder in root.named_modules():
        for path in frozenset().union(*(_direct_forwards(cls) for cls in _model_classes(type(holder)))):
            for name, module in _matching(holder, path.split(".")):
                prefix = f"{holder_name}.{name}" if holder_name else name
                found.update((id(m), n) for n, m in _elements(module, prefix))
        for name, child in holder.named_children():
            prefix = f"{holder_name}.{name}" if holder_name else name
            if id(child) not in found and not isinstance(child, CONTAINERS) and methods_called_by(holder, name, child):
                found[id(child)] = prefix
    return found


def parameters_used_by_holders(root: nn.Module) -> dict[int, str]:
    """The modules under ``root`` whose own parameters the code holding them uses as values, outside the module's
    own call (a tied head ``F.linear(h, self.embed.weight)``; torch's ``MultiheadAttention``, which hands
    ``self.out_proj.weight`` to the functional attention, as FSDP1's size-based policy keeps it whole), by ``id``,
    each with its name. As a unit of its own such a module would be resharded after its forward (or never gathered)
    when the holder computes with its parameters."""
    words = {name for m in root.modules() for name, _ in m.named_parameters(recurse=False)}
    found: dict[int, str] = {}
    for holder_name, holder in root.named_modules():
        reads = {
            (path, word)
            for cls in _model_classes(type(holder))
            for word in words
            for path in _parameter_reads(cls, word)
        }
        reads |= {
            (child, "*") for cls, children in _TORCH_READS.items() if isinstance(holder, cls) for child in children
        }
        for path, word in reads:
            for name, module in _matching(holder, path.split(".")):
                if word == "*" or word in dict(module.named_parameters(recurse=False)):
                    found[id(module)] = f"{holder_name}.{name}" if holder_name else name
    return found


#: torch's own layers whose code uses a child's parameters directly (torch's classes are not read).
_TORCH_READS: dict[type[nn.Module], tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def _matching(module: nn.Module, path: list[str]) -> Iterator[tuple[str, nn.Module]]:
    """The modules under ``module`` a path of attribute names reaches (a part with ``*`` matches by pattern, as an
    f-string's constant prefix does: ``layer_*``), with their names relative to ``module``."""
    if not path:
        return
    for name, child in module.named_children():
        if fnmatch.fnmatchcase(name, path[0]):
            if len(path) == 1:
                yield name, child
            else:
                yield from ((f"{name}.{n}", m) for n, m in _matching(child, path[1:]))


def _elements(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
    """``module`` itself, or the elements of a container (of nested containers too), with their names."""
    if not isinstance(module, CONTAINERS):
        yield name, module
        return
    for child_name, child in module.named_children():
        yield from _elements(child, f"{name}.{child_name}")


def _model_classes(cls: type) -> list[type]:
    """``cls`` and the classes it inherits from, but torch's and ``object``."""
    return [c for c in cls.__mro__ if c is not object and not c.__module__.startswith("torch")]


_SOURCES: dict[tuple[type, str], list[tuple[str, str]]] = {}
_ATTRIBUTE_CALLS: dict[tuple[type, str], frozenset[str]] = {}
_DIRECT_FORWARDS: dict[type, frozenset[str]] = {}
_PARAMETER_READS: dict[tuple[type, str], frozenset[str]] = {}


def _sources_naming(cls: type, word: str) -> list[tuple[str, str]]:
    """The name and source of each function ``cls`` defines whose code names ``word`` (as an attribute or a
    global), found from its compiled code first: reading a whole class's source parses its whole file, which for a
    library's base classes (``PreTrainedModel``, ``LightningModule``) takes longer than the rest of the model's
    set-up."""
    if (cls, word) not in _SOURCES:
        sources = []
        for name, value in vars(cls).items():
            function = _function(value)
            if inspect.isfunction(function) and word in _code_names(function.__code__):
                try:
                    sources.append((name, textwrap.dedent(inspect.getsource(function))))
                except (OSError, TypeError):
                    pass
        _SOURCES[cls, word] = sources
    return _SOURCES[cls, word]


def _function(value: object) -> object:
    """The plain function behind a class attribute (a static or class method, a decorated one)."""
    return inspect.unwrap(value.__func__ if isinstance(value, (staticmethod, classmethod)) else value)  # type: ignore[arg-type]


@functools.cache
def _code_names(code: types.CodeType) -> frozenset[str]:
    """The names a function's code uses, its nested functions' and comprehensions' too."""
    return frozenset(code.co_names).union(*(_code_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _attribute_calls(cls: type, name: str) -> frozenset[str]:
    """What ``cls``'s code calls on ``self.<name>``."""
    if (cls, name) not in _ATTRIBUTE_CALLS:
        pattern = rf"self\.{re.escape(name)}\.([A-Za-z]\w*)\("
        _ATTRIBUTE_CALLS[cls, name] = frozenset(
            m for _, source in _sources_naming(cls, name) for m in re.findall(pattern, source)
        )
    return _ATTRIBUTE_CALLS[cls, name]


def _direct_forwards(cls: type) -> frozenset[str]:
    """The paths from ``self`` (dotted attribute names, ``*`` where an attribute's name is computed) of the modules
    whose ``forward`` (or whose elements' ``forward``) ``cls``'s own code calls."""
    if cls not in _DIRECT_FORWARDS:
        targets: set[str] = set()

        def collect(node: ast.AST, local: dict[str, set[str]]) -> bool:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "forward":
                targets.update(_paths(node.func.value, local))
            return False

        for _, source in _sources_naming(cls, "forward"):
            _walk(source, collect)
        _DIRECT_FORWARDS[cls] = frozenset(targets)
    return _DIRECT_FORWARDS[cls]


def _parameter_reads(cls: type, name: str) -> frozenset[str]:
    """The paths from ``self`` of the modules whose parameter ``name`` (``weight``) ``cls``'s code uses as a value
    (``F.linear(h, self.embed.weight)``), other than in set-up code, which runs before sharding, and other than for
    what a shard answers as the whole does (``self.embed.weight.dtype``, ``.shape``, ``.size(0)``)."""
    if (cls, name) not in _PARAMETER_READS:
        targets: set[str] = set()

        def collect(node: ast.AST, local: dict[str, set[str]]) -> bool:
            if isinstance(node, ast.Attribute):
                if node.attr in _METADATA and isinstance(node.value, ast.Attribute) and node.value.attr == name:
                    return True
                if node.attr == name and isinstance(node.ctx, ast.Load):
                    targets.update(_paths(node.value, local))
            return False

        for function, source in _sources_naming(cls, name):
            if function not in _SET_UP:
                _walk(source, collect)
        _PARAMETER_READS[cls, name] = frozenset(targets)
    return _PARAMETER_READS[cls, name]


#: Functions that run before the model is sharded, or only name its parameters (to group them, to tie them).
_SET_UP = frozenset(
    {
        "__init__",
        "reset_parameters",
        "_reset_parameters",
        "init_weights",
        "_init_weights",
        "post_init",
        "initialize_weights",
        "_initialize_weights",
        "tie_weights",
        "_tie_weights",
        "_tie_or_clone_weights",
        "configure_model",
        "configure_optimizers",
    }
)
#: What a parameter's shard answers as the whole parameter does (FSDP2's DTensor keeps the global shape).
_METADATA = frozenset(
    {
        "dtype",
        "device",
        "shape",
        "ndim",
        "size",
        "dim",
        "numel",
        "nelement",
        "requires_grad",
        "is_cuda",
        "is_floating_point",
        "is_complex",
        "element_size",
        "layout",
    }
)


def _walk(source: str, collect: Callable[[ast.AST, dict[str, set[str]]], bool]) -> None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    _visit(tree, {}, collect)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
#: Methods of a container that iterate over its elements: ``self.table.items()``.
_ITERATING = frozenset({"items", "values", "children", "named_children"})


def _visit(node: ast.AST, local: dict[str, set[str]], collect: Callable[[ast.AST, dict[str, set[str]]], bool]) -> None:
    """Call ``collect`` on each node under ``node`` (whose parts are then left out where it returns True), with
    ``local``: the paths from ``self`` each local name in scope stands for (a loop variable over ``self.layers``, an
    alias ``layer = self.layers[i]``), which assignments in the same scope add to."""
    if isinstance(node, ast.For):
        _visit(node.iter, local, collect)
        inner = {**local, **dict.fromkeys(_names(node.target), _iterated(node.iter, local))}
        for statement in node.body:
            _visit(statement, inner, collect)
        for statement in node.orelse:
            _visit(statement, local, collect)
        return
    if isinstance(node, _COMPREHENSIONS):
        inner = dict(local)
        for generator in node.generators:
            _visit(generator.iter, inner, collect)
            inner.update(dict.fromkeys(_names(generator.target), _iterated(generator.iter, inner)))
            for condition in generator.ifs:
                _visit(condition, inner, collect)
        for element in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
            _visit(element, inner, collect)
        return
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
        _visit(node.value, local, collect)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if paths := _reached(node.value, local):  # ``layer = self.layers[i]``, ``model = self``
            for target in targets:
                if isinstance(target, ast.Name):
                    local[target.id] = paths
        for target in targets:
            if not isinstance(target, ast.Name):
                _visit(target, local, collect)
        return
    if collect(node, local):
        return
    for child in ast.iter_child_nodes(node):
        _visit(child, local, collect)


def _paths(node: ast.AST, local: dict[str, set[str]]) -> set[str]:
    """The paths from ``self`` of the modules the expression ``node`` can be (``self`` itself, whose path is empty,
    left out); an index read at run time (``self.layers[i]``) matches any element (``layers.*``)."""
    return {p for p in _reached(node, local) if p}


def _reached(node: ast.AST, local: dict[str, set[str]]) -> set[str]:
    if isinstance(node, ast.Name):
        return {""} if node.id == "self" else set(local.get(node.id, ()))
    if isinstance(node, ast.Attribute):
        return {_join(p, node.attr) for p in _reached(node.value, local)}
    if isinstance(node, ast.Subscript):  # ``self.layers[i]``: any element; ``self.layers[:n]``: the same container
        index = node.slice
        if isinstance(index, ast.Slice):
            return _reached(node.value, local)
        key = str(index.value) if isinstance(index, ast.Constant) and isinstance(index.value, (str, int)) else "*"
        return {_join(p, key) for p in _reached(node.value, local)}
    if isinstance(node, ast.IfExp):
        return _reached(node.body, local) | _reached(node.orelse, local)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_reached(v, local) for v in node.values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
        name = _attribute_pattern(node.args[1]) if len(node.args) > 1 else None
        return {_join(p, name) for p in _reached(node.args[0], local)} if name else set()
    return set()


def _iterated(node: ast.AST, local: dict[str, set[str]]) -> set[str]:
    """The paths of the modules a loop over ``node`` binds: the elements of ``self.layers``, ``self.table.items()``,
    ``enumerate(self.layers)``, ``zip(self.a, self.b)`` or ``self.layers[:n]`` (a function's call, its arguments'), or
    the modules a literal lists (``(self.a, self.b)``)."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _ITERATING:
            return {_join(p, "*") for p in _paths(func.value, local)}
        if isinstance(func, ast.Attribute):  # a method of the model's (``self.blocks_for(x)``): not read
            return set()
        return set().union(
            *(_iterated(a, local) for a in node.args)
        )  # ``enumerate(...)``, ``zip(...)``, ``chain(...)``
    if isinstance(node, (ast.Tuple, ast.List)):
        return set().union(*(_paths(e, local) for e in node.elts))
    if isinstance(node, ast.BinOp):  # ``self.layers + self.extra``
        return _iterated(node.left, local) | _iterated(node.right, local)
    return {_join(p, "*") for p in _paths(node, local)}


def _attribute_pattern(node: ast.AST) -> str | None:
    """The name ``getattr`` is given, as a pattern: a constant; an f-string's constant start followed by ``*``; ``*``
    for a name computed otherwise."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return (head.value if isinstance(head, ast.Constant) and isinstance(head.value, str) else "") + "*"
    return "*"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
