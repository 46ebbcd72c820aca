"""Evaluation: benchmark datasets (LoCoMo, LoCoMo-Plus), LLM-free retrieval metrics and baselines,
and the QA runner. Import the submodules (``tmem.eval.datasets`` …); this package imports nothing."""
