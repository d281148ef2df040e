"""Spec expressions are bounded (compiler/expr.py on compiler/contract/safe_eval.py's operators): an
exponent, a repetition, a product too large for any size, or an evaluation past its step or time
budget fails at once with the file, line and expression, rather than hanging or exhausting memory."""
import time

import pytest
from test_checkpoint_honesty import BASE

import infc.compiler.build  # noqa: F401 - imported before any clock starts
from infc.cli import main
from infc.compiler import expr
from infc.compiler.contract.errors import SpecError
from infc.compiler.expr import EvalError, evaluate, parse_expr

ABUSES = {
    "tower": ("10 ** 10 ** 10", "too large"),
    "repeat_list": ("[1] * 10**10", "too long"),
    "repeat_string": ("'ab' * 10**9", "too long"),
    "repeat_reversed": ("10**10 * [1]", "too long"),
    "join": ("[0] * 2**19 + [0] * 2**19 + [0] * 2**19", "too long"),
    "product": ("2**1000 * 2**1000", "too large"),
    "format": ("'%*d' % (10**9, 1)", "'%' of a string"),
    "complex": ("(-8) ** 0.5", "not a real number"),
    "overflow_float": ("1e308 * 10", "not a finite number"),
    "int_of_huge_float": ("int(1e308) * int(1e308)", "too large"),
}


@pytest.mark.parametrize("case", sorted(ABUSES))
def test_abusive_expression_fails_fast(case):
    text, message = ABUSES[case]
    t0 = time.perf_counter()
    with pytest.raises(EvalError, match=message):
        evaluate(parse_expr(text, "f.yaml", 3), {})
    assert time.perf_counter() - t0 < 0.5


def test_step_budget(monkeypatch):
    monkeypatch.setattr(expr, "MAX_STEPS", 50)
    with pytest.raises(EvalError, match="more than 50 steps"):
        evaluate(parse_expr(" + ".join(["1"] * 60), None, None), {})


def test_time_budget(monkeypatch):
    monkeypatch.setattr(expr, "TIME_BUDGET", 0.0)
    with pytest.raises(EvalError, match="more than 0.0 s"):
        evaluate(parse_expr(" + ".join(["1"] * 600), None, None), {})


@pytest.mark.parametrize("text", ["-" * 100_000 + "1", "(" * 300 + "1" + ")" * 300, "9" * 5000],
                         ids=["deep_unary", "deep_parentheses", "huge_literal"])
def test_unparseable_monsters_are_spec_errors(text):
    with pytest.raises(SpecError, match="cannot parse expression") as e:
        parse_expr(text, "f.yaml", 7)
    assert str(e.value).startswith("f.yaml:7: ")


def test_ordinary_arithmetic_is_unchanged():
    env = {"H": 4096, "Hq": 32, "L": 3, "pattern": "sliding"}
    assert evaluate(parse_expr("H // Hq", None, None), env) == 128
    assert evaluate(parse_expr("2 ** 63 - 1", None, None), env) == 2**63 - 1
    assert evaluate(parse_expr("[pattern] * L", None, None), env) == ["sliding"] * 3
    assert evaluate(parse_expr("H ** 0.5", None, None), env) == 64.0
    assert evaluate(parse_expr("H % 7", None, None), env) == 4096 % 7


def test_and_or_short_circuit_as_python():
    """`x is None or len(x) == L` with x none: the right side is not evaluated (a config list a
    checkpoint may leave out, GLM-4.7-Flash's mlp_layer_types)."""
    env = {"x": None, "y": [1, 2, 3], "L": 3}
    assert evaluate(parse_expr("x is None or len(x) == L", None, None), env) is True
    assert evaluate(parse_expr("x is not None and len(x) == L", None, None), env) is False
    assert evaluate(parse_expr("y is None or len(y) == L", None, None), env) is True
    assert evaluate(parse_expr("y is not None and len(y) == 2", None, None), env) is False
    with pytest.raises(EvalError):
        evaluate(parse_expr("x is not None or len(x) == L", None, None), env)


def test_the_hanging_spec_fails_the_build_in_under_a_second(capsys, monkeypatch, tmp_path):
    """`name: = 10 ** 10 ** 10` hung `infc build`: now exit 2, file:line and the expression."""
    spec = tmp_path / "tiny.yaml"
    text = BASE.read_text().replace('  act: hidden_act = "silu"\n',
                                    '  act: hidden_act = "silu"\n  big: = 10 ** 10 ** 10\n')
    spec.write_text(text)
    line = text.splitlines().index("  big: = 10 ** 10 ** 10") + 1
    monkeypatch.delenv("INFC_DEBUG", raising=False)
    t0 = time.perf_counter()
    rc = main(["build", "--model", "tiny", "--spec", str(spec), "--no-compile", "--out", str(tmp_path / "o")])
    assert time.perf_counter() - t0 < 1.0
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {spec}:{line}: value of big: cannot evaluate '10 ** 10 ** 10'" in err, err
