"""Which adapter serves a provider name: the one table a new provider is added to.

A provider is a module of this package that builds an adapter from the settings. A chat adapter
implements :class:`tmem.ports.MeteredChatModel` (the call layer, :mod:`tmem.llm`, adds the cache,
the usage ledger, batching and the in-flight bound around it); an embedder implements
:class:`tmem.ports.Embedder`. ``TMEM_LLM_PROVIDER`` names the chat provider (``auto`` picks
``openai`` or ``local``, :func:`resolve_provider`), ``TMEM_EMBEDDING_PROVIDER`` the embedder.

Adding a provider that is not OpenAI-compatible is one module (its adapter and a factory) plus
one registration: a line in :data:`CHAT_PROVIDERS` / :data:`EMBEDDING_PROVIDERS`, or a call of
:func:`register_chat_provider` / :func:`register_embedding_provider` from code that ships its own.
Entries are functions that import their module when first used, so ``openai`` or torch load only
for the provider that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tmem.errors import ConfigError
from tmem.ports import BatchTransport, Embedder, MeteredChatModel

if TYPE_CHECKING:
    from tmem.settings import Role, Settings

ChatAdapterFactory = Callable[["Settings", "Role"], MeteredChatModel]
BatchTransportFactory = Callable[["Settings"], BatchTransport]
# (settings, torch threads: 0 = the library's default) -> embedder
EmbedderFactory = Callable[["Settings", int], Embedder]


@dataclass(frozen=True)
class ChatProvider:
    """A chat provider: its adapter, and its batch endpoint when it has one (``TMEM_LLM_BATCH=on``)."""

    adapter: ChatAdapterFactory
    batch_transport: BatchTransportFactory | None = None


def _openai() -> ChatProvider:
    from tmem.providers import openai_batch, openai_chat

    return ChatProvider(openai_chat.adapter_from_settings, openai_batch.transport_from_settings)


def _sentence_transformers() -> EmbedderFactory:
    from tmem.providers import sentence_transformer

    return sentence_transformer.embedder_for_settings


# The embedded model (``local``) is llama.cpp's server, which speaks the OpenAI API: the CLI starts
# it (tmem.providers.llama_cpp.provider_endpoint) and the ``openai`` adapter talks to it.
CHAT_PROVIDERS: dict[str, Callable[[], ChatProvider]] = {"openai": _openai, "local": _openai}
EMBEDDING_PROVIDERS: dict[str, Callable[[], EmbedderFactory]] = {"sentence-transformers": _sentence_transformers}


def register_chat_provider(name: str, provider: ChatProvider) -> None:
    """Make ``TMEM_LLM_PROVIDER=name`` build its chat adapter with ``provider``."""
    CHAT_PROVIDERS[name] = lambda: provider


def register_embedding_provider(name: str, factory: EmbedderFactory) -> None:
    """Make ``TMEM_EMBEDDING_PROVIDER=name`` build its embedder with ``factory``."""
    EMBEDDING_PROVIDERS[name] = lambda: factory


def resolve_provider(settings: Settings, role: Role = "build") -> str:
    """The chat provider of ``role``. ``auto`` means: the configured endpoint when
    ``TMEM_LLM_BASE_URL`` (or the role's own ``TMEM_LLM_<ROLE>_BASE_URL``) was set, else the
    embedded model. Nothing is probed, so the choice never depends on a network hiccup."""
    if settings.llm_provider != "auto":
        return settings.llm_provider
    configured = {"llm_base_url", f"llm_{role}_base_url"} & settings.model_fields_set
    return "openai" if configured else "local"


def chat_provider(settings: Settings, role: Role) -> ChatProvider:
    name = resolve_provider(settings, role)
    found = CHAT_PROVIDERS.get(name)
    if found is None:
        raise ConfigError(f"TMEM_LLM_PROVIDER={name!r} names no chat provider; known: auto, {', '.join(CHAT_PROVIDERS)}")
    return found()


def embedder_factory(settings: Settings) -> EmbedderFactory:
    found = EMBEDDING_PROVIDERS.get(settings.embedding_provider)
    if found is None:
        raise ConfigError(f"TMEM_EMBEDDING_PROVIDER={settings.embedding_provider!r} names no embedder; "
                          f"known: {', '.join(EMBEDDING_PROVIDERS)}")
    return found()
