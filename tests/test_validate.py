"""rfkit.validate and rfkit.config.args: the small checks every command shares, on their own."""

import pytest

from rfkit.config.args import OneLineParser, parse_betas, parse_bytes, parse_depths, parse_lengths
from rfkit.errors import RFKitError
from rfkit.validate import boolean, fraction, in_range, integer, one_of, positive_int


def message(call) -> str:
    with pytest.raises(RFKitError) as err:
        call()
    return str(err.value)


def test_integers_refuse_bools_and_name_the_field():
    assert positive_int("data.seq_len", 512) == 512 and integer("x", None, optional=True) is None
    assert message(lambda: positive_int("data.seq_len", True)) == "data.seq_len: must be an integer >= 1, got True"
    assert message(lambda: integer("k", 6, 0, multiple_of=4, optional=True)) == "k: must be an integer >= 0 or null, got 6"


def test_ranges_fractions_booleans_and_choices():
    assert fraction("beta", 0.5) == 0.5 and in_range("lr", 1e-3, 0, low_open=True) == 1e-3
    assert message(lambda: fraction("beta", 1.5)) == "beta: 1.5 is not allowed; must be a number in [0, 1]"
    assert message(lambda: in_range("lr", 0, 0, low_open=True)) == "lr: 0 is not allowed; must be a number > 0"
    assert message(lambda: in_range("t", float("nan"), 0)) == "t: nan is not allowed; must be a number >= 0"
    assert message(lambda: boolean("shared", 1)) == "shared: 1 is not allowed; give true or false"
    assert message(lambda: one_of("space", "x", ("output", "mixer"))) == "space: 'x' is not allowed; allowed: output, mixer"


def test_value_parsers_read_lists_and_sizes():
    assert parse_lengths("1_024, 2048") == [1024, 2048]
    assert parse_betas("1,0,0.5,0.5") == [0.0, 0.5, 1.0] and parse_depths("1,0") == [1.0, 0.0]
    assert parse_bytes("2KiB") == 2048 and parse_bytes("1.5kb") == 1500
    assert message(lambda: parse_lengths("0")) == "--lengths: lengths must be positive integers, got 0"
    assert message(lambda: parse_betas("2")) == "--betas: 2.0 is outside [0, 1]; beta is the fraction of heads replaced"


def test_parser_errors_are_one_line_of_the_given_class():
    class Bad(RFKitError):
        pass

    parser = OneLineParser(prog="rfkit x", error_class=Bad, value_hints={"--n": " (an integer)"})
    parser.add_argument("--n", type=int)
    with pytest.raises(Bad) as err:
        parser.parse_args(["--n"])
    assert str(err.value) == "--n: needs a value (an integer)"
