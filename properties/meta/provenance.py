"""Where a safety rule's arguments come from, read off the machines' source.

A safety finding must be true of the implementation: judged on its own state
and answers and on the caller's ledger of the calls it made and what they
answered -- never on the model, which an implementation may legitimately
part from (a convention it declares, or one kvspec does not model yet).  The
harness refuses a safety rule handed the model object itself at run time;
this reads the source for what run time cannot see: a value *derived* from the
model.

A value is derived from the model (*tainted*) when its expression reads a
subject's ``.model``, an answer's ``.expected`` or calls a spec's
``abstract``; a local name assigned from a tainted expression is tainted; an
attribute of the machine (``self.held``) is tainted when anything tainted is
ever stored into it or added to it anywhere in the class; a helper method's
parameter is tainted when some call passes it a tainted value.  Every
``self.check(rule, ...)`` and ``self.check_group(group, ...)`` of a safety
rule (a group holding one) must be given untainted arguments only.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from collections.abc import Iterator

import attrs

from kvspec.spec.invariants import Group, Invariant

MODEL_READS = frozenset({"model", "expected"})  # a subject's model, an answer's expectation
MODEL_CALLS = frozenset({"abstract"})  # the spec's abstraction of its model
STORING_METHODS = frozenset(
    {"update", "add", "append", "extend", "setdefault", "subtract", "insert", "__setitem__", "appendleft"}
)


@attrs.frozen
class Finding:
    """A safety check given a value derived from the model."""

    where: str  # module:Class.method
    line: int
    rule: str
    argument: str


@attrs.frozen
class Taint:
    """What is derived from the model in one method: its names, the machine's attributes, and the machine's
    methods whose answer is."""

    names: frozenset[str] = frozenset()
    attributes: frozenset[str] = frozenset()
    answering: frozenset[str] = frozenset()  # methods whose return value is derived from the model
    methods: frozenset[str] = frozenset()  # every method of the machine
    functions: frozenset[str] = frozenset()  # module-level names of functions, classes and modules, and the builtins


def reads_model(node: ast.AST, taint: Taint) -> bool:
    """Whether the expression ``node`` reads the model, directly or through a tainted name, attribute or method.

    What a call is asked is the caller's choice, whatever chose it: the answer of a call to the implementation
    (a subject, an implementation's method) is the implementation's.  A function's answer (a spec function, a
    builtin) is as tainted as what it is given; one of the machine's own methods, as what it returns."""
    if isinstance(node, ast.Call):
        called = node.func
        if own_method(called, taint):
            assert isinstance(called, ast.Attribute)
            return called.attr in taint.answering
        if (called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")) in MODEL_CALLS:
            return True
        if reads_model(called, taint):
            return True
        root = called.value if isinstance(called, ast.Attribute) else called
        if not (isinstance(root, ast.Name) and root.id in taint.functions):
            return False  # a call to the implementation
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        return any(reads_model(argument, taint) for argument in arguments)
    if isinstance(node, ast.Attribute):
        if node.attr in MODEL_READS:
            return True
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in taint.attributes:
            return True
    elif isinstance(node, ast.Name):
        return node.id in taint.names
    return any(reads_model(child, taint) for child in ast.iter_child_nodes(node))


def own_method(called: ast.AST, taint: Taint) -> bool:
    """Whether ``called`` is ``self.m`` for one of the machine's methods ``m``."""
    return (
        isinstance(called, ast.Attribute)
        and isinstance(called.value, ast.Name)
        and called.value.id == "self"
        and called.attr in taint.methods
    )


def stored_attribute(node: ast.AST) -> str | None:
    """``x`` when ``node`` is ``self.x`` or ``self.x[...]``: where a statement stores a value."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def methods_of(tree: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def local_taint(method: ast.FunctionDef, taint: Taint) -> Taint:
    """``taint`` with the names of ``method`` derived from the model: assignments, to a fixed point."""
    names = set(taint.names)
    changed = True
    while changed:
        changed = False
        for node in ast.walk(method):
            targets: list[ast.AST] = []
            value: ast.AST | None = None
            if isinstance(node, ast.Assign):
                targets, value = list(node.targets), node.value
            elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            elif isinstance(node, ast.For | ast.comprehension):
                targets, value = [node.target], node.iter
            elif isinstance(node, ast.NamedExpr):
                targets, value = [node.target], node.value
            if value is None or not reads_model(value, attrs.evolve(taint, names=frozenset(names))):
                continue
            for name in (name for target in targets for name in bound_names(target)):
                if name not in names:
                    names.add(name)
                    changed = True
    return attrs.evolve(taint, names=frozenset(names))


def bound_names(target: ast.AST) -> Iterator[str]:
    """The local names an assignment to ``target`` binds (``a``, ``a, b``, ``*rest``; never ``self.x``)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for item in target.elts:
            yield from bound_names(item)
    elif isinstance(target, ast.Starred):
        yield from bound_names(target.value)


def stores(node: ast.AST) -> list[tuple[str | None, ast.AST]]:
    """What the statement or call ``node`` stores into the machine's attributes: (attribute, value) pairs."""
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value is not None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [(stored_attribute(target), node.value) for target in targets]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORING_METHODS:
        return [(stored_attribute(node.func.value), arg) for arg in node.args]
    return []


def class_taint(tree: ast.ClassDef, inherited: Taint) -> tuple[Taint, dict[str, Taint]]:
    """The machine's taint (its attributes, its methods answering the model) and each method's, to a fixed
    point.  A method's parameters are the caller's choices (which sequence, how many blocks), never tainted:
    a value derived from the model reaches a rule through a name, an attribute or a return."""
    methods = methods_of(tree)
    machine = attrs.evolve(inherited, methods=inherited.methods | methods.keys())
    changed = True
    while changed:
        changed = False
        for name, method in methods.items():
            local = local_taint(method, machine)
            for node in ast.walk(method):
                for attribute, value in stores(node):
                    if attribute and attribute not in machine.attributes and reads_model(value, local):
                        machine = attrs.evolve(machine, attributes=machine.attributes | {attribute})
                        changed = True
                if isinstance(node, ast.Return) and node.value is not None and name not in machine.answering:
                    if reads_model(node.value, local):
                        machine = attrs.evolve(machine, answering=machine.answering | {name})
                        changed = True
    return machine, {name: local_taint(method, machine) for name, method in methods.items()}


def holds_safety(rule: object) -> bool:
    if isinstance(rule, Invariant):
        return rule.tier == "safety"
    return isinstance(rule, Group) and any(member.tier == "safety" for member in rule.invariants)


def safety_checks_reading_the_model(module_name: str) -> Iterator[Finding]:
    """Every safety check of the machines of ``module_name`` given a value derived from the model."""
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    inherited: dict[str, Taint] = {}
    functions = frozenset(
        name
        for name, value in vars(module).items()
        if inspect.ismodule(value) or inspect.isroutine(value) or inspect.isclass(value)
    ) | frozenset(dir(builtins))
    for name, klass in classes.items():  # bases first: a module defines them before their subclasses
        bases = [inherited[base.id] for base in klass.bases if isinstance(base, ast.Name) and base.id in inherited]
        start = Taint(
            functions=functions,
            attributes=frozenset().union(*(base.attributes for base in bases)),
            answering=frozenset().union(*(base.answering for base in bases)),
            methods=frozenset().union(*(base.methods for base in bases)),
        )
        inherited[name], tainted = class_taint(klass, start)
        for method_name, method in methods_of(klass).items():
            yield from checks_in(module, f"{module_name}:{name}.{method_name}", method, tainted[method_name])


def checks_in(module: object, where: str, method: ast.FunctionDef, taint: Taint) -> Iterator[Finding]:
    for node in ast.walk(method):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("check", "check_group") or not node.args:
            continue
        try:
            rule = eval(ast.unparse(node.args[0]), vars(module))  # a rule is named by reference: model.invariant_x
        except Exception:  # noqa: BLE001 -- a rule held in a local name: judged where it is chosen
            continue
        if not holds_safety(rule):
            continue
        for argument in node.args[1:]:
            if reads_model(argument, taint):
                yield Finding(where, node.lineno, getattr(rule, "name", "group"), ast.unparse(argument))
