"""Context parallelism: each row's tokens split over the cp ranks, attention exchanging keys
and values; one concern per module, import from the module.

cut       which of a row's tokens each rank holds (pure: head-tail pieces per document)
exchange  the all-gather of each layer's keys and values, their gradients reduce-scattered
ring      ring attention: keys and values passed rank to rank, merged by log-sum-exp
packing   ContextPacking: the Packing a rank's model attends with (its tokens' places,
          positions and documents, and how it reaches the others' keys)

Everything outside attention is per token, so nothing else changes: the loss divides by
the global target count, the gradients are reduced over dp x cp (`Mesh.replicas_axis`).
"""
