"""Shorter sequences (truncation): only with the user's consent (`--allow truncation`).

Activations grow with the length (attention scores with its square). Truncating changes
the data; when example lengths are known, the plan says how many examples would be cut.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.sequence_length <= 128:
        return Applicability(False, "sequences are already short (<= 128 tokens)")
    return Applicability(True, "activations grow with length; attention with its square")


def _variants(setup, gpu):
    seq = setup.sequence_length
    out = []
    for frac in (0.75, 0.5, 0.25):
        n = max(128, int(seq * frac) // 64 * 64)
        if n < seq and {"max_length": n, "truncation": True} not in out:
            out.append({"max_length": n, "truncation": True})
    return out


def _apply(changes, setup, **_):
    n = changes["max_length"]
    code = [f"tokenizer(..., truncation=True, max_length={n})  # an explicit max_length: some tokenizers "
            "(XLNet) have no limit, so truncation=True alone cuts nothing"]
    if setup.example_lengths:
        cut = sum(1 for x in setup.example_lengths if x > n)
        code.append(f"# {cut} of {len(setup.example_lengths)} examples are longer than {n} tokens and get cut")
    return {}, {}, code


REMEDY = Remedy(
    name="truncation", title="shorter sequences", opt_in=True,
    saves="activations (quadratic part: attention)", costs="cuts the text of long examples",
    check=_check, variants=_variants, apply=_apply,
    fields=("max_length", "truncation"), advice=("truncation",),
)
