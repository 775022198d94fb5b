"""The aiohttp server: OpenAI Chat Completions / Completions / Responses and Anthropic Messages over one engine.

`create_app(ServerConfig(model=DIR))` gives the app (the engine starts with it); `run_server` serves it on uvloop.
See docs/server.md.
"""

from deepserve.server.app import create_app, run_server
from deepserve.server.config import ServerConfig
from deepserve.server.state import ADMISSION, CONFIG, ENGINE, METRICS, MODEL, ModelInfo

__all__ = ["create_app", "run_server", "ServerConfig", "ModelInfo", "ADMISSION", "CONFIG", "ENGINE", "METRICS",
           "MODEL"]
