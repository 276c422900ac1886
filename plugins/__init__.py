"""The built-in plugins of torch-handle, installed as ``handle_plugins``.

They are ordinary plugins: registered through the ``handle`` entry-point group like any third-party one
(see pyproject.toml), depending on ``torch_handle`` and never the reverse. Module import is kept cheap (no
torch); the heavy code is imported inside the factories.
"""
