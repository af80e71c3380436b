"""The demo and benchmark harness of ``python -m ple_memops demo`` and ``bench``: not a
library API. Nothing of :mod:`ple_memops`, :mod:`ple_memops.transformers` or
:mod:`ple_memops.vllm` imports it; it uses their public API (``ple_memops.transformers.serve``
and the :class:`~ple_memops.transformers.ServedModel` it returns, the errors, ``probe``),
as any user of the library would. Its names may change with the commands they serve.

- :mod:`.cli`: the two commands' options and main functions, ``load_gemma`` (a Gemma 3n
  checkpoint served and moved to its device), ``relayer`` (a config with another number
  of layers), ``qwen_main`` (the Qwen4Exp check of ``bench --qwen``).
- :mod:`.runner`: ``GemmaBench``, which runs the variants of one served Gemma 3n model
  side by side; its jobs: :mod:`.decode` (the captured decode step, the variants' names,
  a run's record), :mod:`.variants` (each variant's host side), :mod:`.timing` (the
  timing loop), :mod:`.state` (the state checks) and :mod:`.capture` (what a captured
  Gemma 3n step needs from transformers' code).
- :mod:`.report`: the tables, the summary and the plot of the results.
- :mod:`.checkpoints`: random-weight checkpoints written by transformers'
  ``save_pretrained`` (tiny, E2B-shaped, Qwen4Exp).
- :mod:`.qwen`: Qwen4Exp's check against the stock model.
- :mod:`.tp`: tensor parallelism 2 (``torchrun --nproc_per_node=2 -m ple_memops.demo.tp``).

Importing this package imports none of its modules, nor torch or transformers.
"""
