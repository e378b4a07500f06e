"""Comparing integer codes of two quantizers that may round exact ties differently."""

from __future__ import annotations


def assert_codes_match_up_to_ties(got, ref, t, step, slack):
    """Integer-grid codes from the library (float32) against a float64 reference, compared through their
    dequantized values ``got``/``ref`` (float64): ``t`` is the float64 value the reference rounds (x/s, +zp),
    ``step`` the code step s, ``slack`` the float32 rounding bound of ``t``. A correctly rounded float32
    quotient is within that slack of the float64 one, so a code may differ only where ``t`` lies within it of
    a half-integer tie, and then by one step; any other difference is a real defect."""
    near = (t - t.floor() - 0.5).abs() <= slack
    diff = (got - ref).abs() > step / 2  # a different code moves the value by a whole step
    assert not bool((diff & ~near).any())
    assert bool(((got - ref).abs()[diff] <= step[diff] * (1 + 1e-6)).all())
