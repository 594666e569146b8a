"""Requests and their prompts: chat messages -> prompt ids + image placeholders."""
