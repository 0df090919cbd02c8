"""A calculator tool for `tools.functions` (examples/smollm2_calculator.yaml):
`examples/tools/calculator.py:calculator`.

It evaluates an arithmetic expression exactly (Python integers, so large operands stay exact)
by walking its syntax tree: numbers, + - * / // % **, unary minus and parentheses, nothing else
(no names, no calls), and exponents of at most 64 so that no answer grows without bound. A bad
expression raises ValueError, which the model reads back as a tool error.
"""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
             ast.Pow: operator.pow}
MAX_EXPONENT = 64


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "48213 * 7702 + 15".

    Args:
        expression: numbers combined with + - * / // % ** and parentheses
    """
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as an arithmetic expression") from None
    try:
        value = _value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
