"""The HTTP API: an OpenAI-compatible FastAPI app over the AsyncEngine (`create_app`)."""

from nanollmserve.api.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
