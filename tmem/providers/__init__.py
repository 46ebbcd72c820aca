"""Model adapters only: each module speaks one library or wire protocol behind a port of
:mod:`tmem.ports`; :mod:`tmem.providers.registry` names them.

| module | adapter |
|---|---|
| :mod:`tmem.providers.openai_chat` | chat over any OpenAI-compatible endpoint (the ``openai`` client) |
| :mod:`tmem.providers.openai_batch` | the OpenAI Batch API (files and batches) |
| :mod:`tmem.providers.sentence_transformer` | sentence-transformers embeddings (CPU) |
| :mod:`tmem.providers.llama_cpp` | the embedded model: starts llama.cpp's OpenAI-compatible server |
| :mod:`tmem.providers.llama_cpp_server` | that server's process (grammar-constrained JSON) |
"""
