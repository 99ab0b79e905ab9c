"""The OpenAI-compatible API: request/response models, errors, handlers and routes."""
