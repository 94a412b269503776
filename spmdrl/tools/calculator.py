"""Exact arithmetic on integers and decimals, parsed with `ast` and evaluated node by node (never eval).

Integers are exact and unbounded up to MAX_DIGITS digits; a number written with a point or an exponent is a
Decimal, and so is a quotient that is not a whole number (50 significant digits). Operators: + - * / // % **
and parentheses. Anything else (names, calls, attributes, strings, comparisons) is refused with a message
that says what is allowed.
"""
from __future__ import annotations

import ast
import decimal

MAX_DIGITS = 4000
"""Largest integer result, in decimal digits (Python's default int -> str limit is 4300)."""
MAX_CHARS = 10_000
PRECISION = 50
_MAX_BITS = int(MAX_DIGITS * 3.3219280948873626)  # log2(10)
_CONTEXT = decimal.Context(prec=PRECISION, Emax=MAX_DIGITS, Emin=-MAX_DIGITS,
                           traps=[decimal.InvalidOperation, decimal.DivisionByZero, decimal.Overflow])
ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalculatorError(ValueError):
    """A bad expression; its message is what the model sees."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError(f"give an arithmetic expression ({ALLOWED})")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}; use {ALLOWED}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError(f"cannot parse {expression!r}; use {ALLOWED}") from None
    try:
        value = _Eval(text).visit(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except decimal.DivisionByZero:
        raise CalculatorError("division by zero") from None
    except decimal.Overflow:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits") from None
    except decimal.InvalidOperation:
        raise CalculatorError("the operation is undefined (e.g. 0/0, or a fractional power of a negative number)") \
            from None
    return _format(value)


def _format(value) -> str:
    if isinstance(value, int):
        return str(value)
    value = value.normalize(_CONTEXT)
    if -20 < value.adjusted() < PRECISION:
        return format(value, "f")  # 1E+2 -> 100, 1.50 -> 1.5
    return str(value)


def _check_int(n: int) -> int:
    if n.bit_length() > _MAX_BITS:
        _too_big()
    return n


class _Eval(ast.NodeVisitor):
    def __init__(self, source: str):
        self.source = source

    def generic_visit(self, node):
        what = type(node).__name__.lower()
        raise CalculatorError(f"{what} is not arithmetic; use {ALLOWED}")

    def visit_Constant(self, node):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CalculatorError(f"{v!r} is not a number; use {ALLOWED}")
        if isinstance(v, int):
            return _check_int(v)
        literal = ast.get_source_segment(self.source, node) or repr(v)
        return decimal.Decimal(literal.replace("_", ""))  # the written digits, not the float's binary value

    def visit_UnaryOp(self, node):
        v = self.visit(node.operand)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed; use {ALLOWED}")

    def visit_BinOp(self, node):
        a, b = self.visit(node.left), self.visit(node.right)
        op = node.op
        if isinstance(op, ast.Pow):
            return self._pow(a, b)
        if isinstance(a, int) and isinstance(b, int):
            if isinstance(op, ast.Add):
                return _check_int(a + b)
            if isinstance(op, ast.Sub):
                return _check_int(a - b)
            if isinstance(op, ast.Mult):
                if a.bit_length() + b.bit_length() > _MAX_BITS + 1:  # the product has at least sum - 1 bits
                    _too_big()
                return _check_int(a * b)
            if isinstance(op, ast.FloorDiv):
                return a // b
            if isinstance(op, ast.Mod):
                return a % b
            if isinstance(op, ast.Div):
                if b == 0:
                    raise ZeroDivisionError
                if a % b == 0:
                    return a // b
                return _CONTEXT.divide(decimal.Decimal(a), decimal.Decimal(b))
        da, db = _dec(a), _dec(b)
        if isinstance(op, ast.Add):
            return _CONTEXT.add(da, db)
        if isinstance(op, ast.Sub):
            return _CONTEXT.subtract(da, db)
        if isinstance(op, ast.Mult):
            return _CONTEXT.multiply(da, db)
        if isinstance(op, ast.Div):
            return _CONTEXT.divide(da, db)
        if isinstance(op, ast.FloorDiv):
            return _CONTEXT.divide_int(da, db)
        if isinstance(op, ast.Mod):
            return _CONTEXT.remainder(da, db)
        raise CalculatorError(f"the operator {type(op).__name__} is not allowed; use {ALLOWED}")

    def _pow(self, a, b):
        if isinstance(a, int) and isinstance(b, int):
            if b < 0:
                if a == 0:
                    raise ZeroDivisionError
                return _CONTEXT.power(decimal.Decimal(a), b)
            if abs(a) > 1 and (a.bit_length() - 1) * b > _MAX_BITS:
                _too_big()
            return _check_int(a ** b)
        return _CONTEXT.power(_dec(a), _dec(b))


def _dec(v) -> decimal.Decimal:
    return decimal.Decimal(v) if isinstance(v, int) else v


def _too_big():
    raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
