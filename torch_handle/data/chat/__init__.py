"""Conversations: chat templates, trained-token masks, packing (issue 46)."""
