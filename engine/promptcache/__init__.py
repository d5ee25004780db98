"""Prompt modules (Prompt Cache's PML) and position-independent segments.

Torch-free: the PML parser and compiler, the schema registry, and the
:class:`~engine.promptcache.segments.SegmentedPrompt` plan that tells the engine
which runs of a prompt may reuse KV computed elsewhere. The KV side (module blocks,
re-rotation, recovery) lives in the engine core and model.
"""
