"""Process groups and every collective hf_longctx issues.

`groups.py` builds the SP/DP groups once (`SequenceParallelGroups`, passed down explicitly);
`comm.py` holds the autograd collectives of Ulysses and the loss, `ring_comm.py` the ring's
point-to-point passes; `failures.py` turns a collective that cannot complete into a bounded wait and
an error naming the op and the ranks.
"""
