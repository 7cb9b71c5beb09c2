"""GitHub Actions' expression language, for running workflows here (scripts/run_workflow.py).

What ``${{ }}`` and ``if:`` hold (docs.github.com, "Evaluate expressions in
workflows and actions"): literals, context property access (``a.b``,
``a['b']``), ``! == != < <= > >= && ||`` and parentheses, the status functions
and ``contains``, ``startsWith``, ``endsWith``, ``format``, ``toJSON``,
``fromJSON``. ``&&`` and ``||`` return an operand, not a boolean; string
comparison ignores case; a missing property is null.
"""

from __future__ import annotations

import json
import re

__all__ = [
    "DEFAULT_STATUS",
    "STATUS_FUNCTIONS",
    "ExpressionError",
    "condition",
    "evaluate",
    "interpolate",
    "to_string",
]


class ExpressionError(ValueError):
    """An expression this runner cannot parse or evaluate."""


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>'(?:[^']|'')*')
      | (?P<number>-?\d+(?:\.\d+)?)
      | (?P<op>\|\||&&|==|!=|<=|>=|<|>|!|\(|\)|\[|\]|,|\.|\*)
      | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
    )""",
    re.VERBOSE,
)

STATUS_FUNCTIONS = ("success", "failure", "always", "cancelled")


def _tokens(text: str) -> list[tuple[str, object]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise ExpressionError(f"cannot parse {text!r} at {text[pos:]!r}")
        pos = match.end()
        kind = match.lastgroup
        value = match.group(kind)
        if kind == "string":
            out.append(("lit", value[1:-1].replace("''", "'")))
        elif kind == "number":
            out.append(("lit", float(value) if "." in value else int(value)))
        elif kind == "name" and value in ("true", "false", "null"):
            out.append(("lit", {"true": True, "false": False, "null": None}[value]))
        else:
            out.append((kind, value))
    return out


def _truthy(value) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, float) and value == 0)


def _number(value):
    if isinstance(value, bool):
        return int(value)
    if value is None:
        return 0
    if isinstance(value, int | float):
        return value
    try:
        return float(str(value).strip() or 0)
    except ValueError:
        return float("nan")


def _compare(op: str, left, right) -> bool:
    if isinstance(left, str) and isinstance(right, str):
        left, right = left.casefold(), right.casefold()
    elif type(left) is not type(right):
        left, right = _number(left), _number(right)
    return {
        "==": lambda: left == right,
        "!=": lambda: left != right,
        "<": lambda: left < right,
        "<=": lambda: left <= right,
        ">": lambda: left > right,
        ">=": lambda: left >= right,
    }[op]()


def to_string(value) -> str:
    """An expression value as ``${{ }}`` substitutes it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


class _Parser:
    def __init__(self, text: str, context: dict, status: dict):
        self.tokens, self.i, self.context, self.status = _tokens(text), 0, context, status
        self.text = text

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None)

    def take(self, value=None):
        token = self.peek()
        if token[0] is None or (value is not None and token[1] != value):
            raise ExpressionError(f"expected {value or 'more'} in {self.text!r}")
        self.i += 1
        return token

    def parse(self):
        value = self.or_()
        if self.i != len(self.tokens):
            raise ExpressionError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return value

    def or_(self):
        value = self.and_()
        while self.peek() == ("op", "||"):
            self.take()
            right = self.and_()
            value = value if _truthy(value) else right
        return value

    def and_(self):
        value = self.comparison()
        while self.peek() == ("op", "&&"):
            self.take()
            right = self.comparison()
            value = right if _truthy(value) else value
        return value

    def comparison(self):
        value = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in ("==", "!=", "<", "<=", ">", ">="):
            op = self.take()[1]
            value = _compare(op, value, self.unary())
        return value

    def unary(self):
        if self.peek() == ("op", "!"):
            self.take()
            return not _truthy(self.unary())
        return self.postfix()

    def postfix(self):
        kind, value = self.peek()
        if kind == "lit":
            self.take()
            result = value
        elif kind == "op" and value == "(":
            self.take()
            result = self.or_()
            self.take(")")
        elif kind == "name":
            self.take()
            if self.peek() == ("op", "("):
                return self.call(value)
            result = self.context.get(value)
        else:
            raise ExpressionError(f"unexpected {value!r} in {self.text!r}")
        while self.peek() in (("op", "."), ("op", "[")):
            if self.take()[1] == ".":
                result = _member(result, self.take()[1])
            else:
                result = _member(result, self.or_())
                self.take("]")
        return result

    def call(self, name: str):
        self.take("(")
        args = []
        while self.peek() != ("op", ")"):
            args.append(self.or_())
            if self.peek() == ("op", ","):
                self.take()
        self.take(")")
        if name in STATUS_FUNCTIONS:
            return self.status[name]
        functions = {
            "contains": lambda a, b: (
                any(_compare("==", x, b) for x in a)
                if isinstance(a, list)
                else to_string(b).casefold() in to_string(a).casefold()
            ),
            "startsWith": lambda a, b: to_string(a).casefold().startswith(to_string(b).casefold()),
            "endsWith": lambda a, b: to_string(a).casefold().endswith(to_string(b).casefold()),
            "format": lambda f, *xs: re.sub(
                r"\{(\d+)\}", lambda m: to_string(xs[int(m.group(1))]), to_string(f)
            ),
            "toJSON": lambda x: json.dumps(x, indent=2),
            "fromJSON": lambda x: json.loads(to_string(x)),
        }
        if name not in functions:
            raise ExpressionError(f"function {name}() is not supported here")
        return functions[name](*args)


def _member(value, key):
    if isinstance(value, dict):
        if key in value:
            return value[key]
        lowered = {str(k).casefold(): v for k, v in value.items()}  # contexts ignore case
        return lowered.get(str(key).casefold())
    if isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
        return value[key]
    return None


DEFAULT_STATUS = {"success": True, "failure": False, "always": True, "cancelled": False}


def evaluate(expression: str, context: dict, status: dict | None = None):
    """The value of one expression (without ``${{ }}``) in ``context``."""
    return _Parser(expression, context, status or DEFAULT_STATUS).parse()


# An expression ends at the first "}}": "${{ a }}${{ b }}" is two of them.
_INTERPOLATION = re.compile(r"\$\{\{((?:(?!\}\}).)*)\}\}", re.DOTALL)


def interpolate(value, context: dict, status: dict | None = None):
    """``value`` with every ``${{ expr }}`` replaced; dicts and lists recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, context, status) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, context, status) for v in value]
    if not isinstance(value, str):
        return value
    whole = _INTERPOLATION.fullmatch(value.strip())
    if whole:  # a value that is one expression keeps its type (a list for runs-on, ...)
        return evaluate(whole.group(1), context, status)
    return _INTERPOLATION.sub(lambda m: to_string(evaluate(m.group(1), context, status)), value)


def condition(text, context: dict, status: dict) -> bool:
    """An ``if:`` value: ``${{ }}`` optional; without a status function, ``success() && (...)``."""
    if text is None:
        return status["success"]
    if isinstance(text, bool):
        return text and status["success"]
    expression = str(text).strip()
    whole = _INTERPOLATION.fullmatch(expression)
    if whole:
        expression = whole.group(1)
    if not re.search(r"\b(" + "|".join(STATUS_FUNCTIONS) + r")\s*\(", expression):
        expression = f"success() && ({expression})"
    return _truthy(evaluate(expression, context, status))
