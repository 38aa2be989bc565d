"""What the data makes of a batch: the examples' token lengths, the collator's padding, length grouping and
packing, and the worst batch the sampler can form (memfit.inputs.lengths); the data files themselves
(memfit.inputs.data_file, the reader `memfit train` uses too)."""

from memfit.inputs.data_file import read_rows, read_texts
from memfit.inputs.lengths import DataLengths, WorstBatch, data_lengths, padded_length, token_lengths, worst_batch

__all__ = ["DataLengths", "WorstBatch", "data_lengths", "padded_length", "read_rows", "read_texts", "token_lengths",
           "worst_batch"]
