"""OpenAI- and Anthropic-compatible HTTP server around one engine."""

from flashpack.runtime.server.app import create_app, serve
from flashpack.runtime.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]
