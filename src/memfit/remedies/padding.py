"""Dynamic padding and length grouping: faster on average, same worst case.

The peak is set by the longest batch, which dynamic padding (DataCollatorWithPadding) and
`group_by_length=True` do not shorten. They save time, not peak memory, so the planner
reports them but never counts them as making a run fit.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    return Applicability(False, "the peak is set by the longest padded batch; padding strategy does not lower it")


REMEDY = Remedy(
    name="padding", title="dynamic padding / group_by_length",
    saves="nothing at the peak (average batches get shorter)", costs="none",
    check=_check, variants=lambda setup, gpu: [], apply=lambda changes, setup, **_: ({"group_by_length": True}, {}, []),
)
