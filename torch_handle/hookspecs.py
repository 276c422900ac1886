"""Hook specifications of the ``handle`` plugin system (pluggy).

A plugin is a module (or object) exposed through the ``handle`` entry-point group; the built-in plugins use the
same group. Each hook receives a ``register`` callback, so the core owns naming and duplicate detection:

    from torch_handle.hookspecs import hookimpl

    @hookimpl
    def handle_register_strategies(register):
        register("my-strategy", MyStrategyConfig, build_my_strategy, "one-line description")

For models, datasets, strategies and profilers, ``register(name, config_cls, factory, description="",
check_preset=None)`` takes the name that a preset's ``name`` key selects, the dataclass that validates the rest of that preset table, and a
factory called on every rank when a run starts (its arguments depend on the kind; see ``docs/plugins.md``).
``check_preset(options, preset)`` checks settings that span tables: it raises an ``InvalidValue`` or yields each
one (every one is reported); a tuple of such checks runs each on its own (:mod:`torch_handle.config.problems`).
Sinks, presets and commands register differently (see their hooks). Hooks are called once, in the ``handle``
process and in every worker, when the plugin registry is first built. Keep module import cheap: import torch
inside the factory, not at module level, so ``handle --help`` and preset validation stay instant.
"""

import pluggy

hookspec = pluggy.HookspecMarker("handle")
hookimpl = pluggy.HookimplMarker("handle")


@hookspec
def handle_register_models(register):
    """Register model plugins: ``factory(options, vocab_size: int, pad_id: int, max_len: int) -> nn.Module``.

    ``register(..., preflight=fn)``: ``fn(options, preset)`` checks what the model will read (the ``transformer``
    plugin: its ``init_from`` directory) in the ``handle`` process before a new run starts, raising
    ``CheckpointError``; a resume skips it (its checkpoint holds the weights).
    """


@hookspec
def handle_register_datasets(register):
    """Register dataset plugins: ``factory(options, ctx: DataContext) -> DataBundle`` (train/valid + tokenizer).

    ``register(..., preflight=fn)`` (datasets only): ``fn(options)`` checks the input cheaply in the ``handle``
    process before ``handle run`` / ``handle validate`` go further, raising ``DataError``.

    ``register(..., prepare=fn)`` (datasets only): ``fn(options, cache, progress) -> DataIdentity | None`` readies
    the data in the launcher, before any worker starts (no torch; ``DataError`` for bad input), so that the
    factory only opens it: no rank waits at a collective while another prepares.
    """


@hookspec
def handle_register_strategies(register):
    """Register strategy plugins: ``factory(options, training, ctx: DistContext, model) -> Strategy``."""


@hookspec
def handle_register_profilers(register):
    """Register profiler plugins: ``factory(options, trace_dir: Path, rank: int) -> Profiler``."""


@hookspec
def handle_register_presets(register):
    """Contribute presets: ``register(directory)`` with a directory of ``*.toml`` presets shipped by the plugin.

    ``handle presets list`` shows them, and ``handle run NAME`` / ``validate`` / ``presets show`` find a bare
    NAME there when ``./presets/NAME.toml`` does not exist. ``extends`` inside them resolves relative to their
    own directory. A directory that does not exist fails the plugin.
    """


@hookspec
def handle_register_commands(register):
    """Contribute CLI commands: ``register(command)`` with a ``click.Command`` (or ``click.Group``).

    The command appears as ``handle <command.name>``. It can never shadow a core command (``run``, ``validate``,
    ``plugins``, ...): such a command is refused, the rest of the plugin keeps working, and ``handle plugins
    list`` reports the refusal. Two plugins registering the same command name: the second plugin fails, as for
    any duplicate name.
    """


@hookspec
def handle_register_sinks(register):
    """Register telemetry sinks: ``register(name, factory, description="")`` (no config class: a sink has no
    preset table), ``factory(run_dir: Path, preset: Preset) -> Sink | None``.

    On rank 0 only, once the run is built, every registered factory is called; the sink it returns gets every
    later event (``Sink.emit(event: dict)``, after the event was written to ``events.jsonl``) and ``close()`` at
    the end; None means the sink has nothing to do for this run (for example, a setting it needs is absent).
    A sink that raises in its factory, ``emit`` or ``close`` is disabled with one warning ``log`` event; the run
    goes on unchanged. See :class:`torch_handle.observe.telemetry.Sink`.
    """
