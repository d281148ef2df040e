"""The templates' `next_pow2` filter (compiler/codegen/render.py): the power-of-two tile extent
that covers a size, with an optional floor."""
import jinja2
import pytest

from infc.compiler.codegen.render import TemplateError, _env, next_pow2, render_template


@pytest.mark.parametrize("x,want", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32),
                                    (1023, 1024), (1024, 1024), (1025, 2048), (151936, 262144),
                                    (-3, 1), (2.5, 4)])
def test_next_pow2(x, want):
    assert next_pow2(x) == want


@pytest.mark.parametrize("x,floor,want", [(0, 16, 16), (1, 16, 16), (16, 16, 16), (17, 16, 32),
                                          (9, 2, 16), (1, 2, 2), (64, 64, 64), (65, 64, 128)])
def test_next_pow2_floor(x, floor, want):
    assert next_pow2(x, floor) == want


def test_next_pow2_is_the_templates_filter():
    env = _env()
    assert env.from_string("{{ 17 | next_pow2 }} {{ 3 | next_pow2(16) }} {{ 40 | next_pow2(16) }}").render() \
        == "32 16 64"


@pytest.mark.parametrize("x,floor,what", [("8", 1, "needs a number"), (None, 1, "needs a number"),
                                          (True, 1, "needs a number"), (float("inf"), 1, "needs a number"), (5, 12, "floor must be a power of two"),
                                          (5, 0, "floor must be a power of two")])
def test_next_pow2_refuses(x, floor, what):
    with pytest.raises(TemplateError, match=what):
        next_pow2(x, floor)


def test_next_pow2_error_names_the_template(tmp_path):
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "bad.py.j2").write_text("X = {{ attrs.n | next_pow2 }}\n")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)), undefined=jinja2.StrictUndefined)
    env.filters["next_pow2"] = next_pow2
    with pytest.raises(TemplateError, match=r"triton/bad\.py\.j2: next_pow2 needs a number, got 'a'"):
        render_template("triton", "bad", {"attrs": {"n": "a"}}, env=env)


def test_next_pow2_of_an_undefined_is_jinjas_error(tmp_path):
    """An undefined operand fails as the comparison loop it replaced did: jinja2's own message."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "und.py.j2").write_text("X = {{ inputs[1] | next_pow2(16) }}\n")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)), undefined=jinja2.StrictUndefined)
    env.filters["next_pow2"] = next_pow2
    with pytest.raises(TemplateError, match=r"triton/und\.py\.j2: list object has no element 1"):
        render_template("triton", "und", {"inputs": [{"shape": [3]}]}, env=env)
