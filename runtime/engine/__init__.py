"""The engine: how a step runs.

    config.py         EngineConfig: every setting, with its default and why
    settings.py       `--set KEY=VALUE` onto an EngineConfig
    build.py          load_engine(pack, config) -> Engine: the store, the model, the step, generation
    engine.py         Engine: what the server, verify and bench hold
    expert_paths.py   the model's routed experts from an expert source (bank, tiered store, plain)
    step.py           the step: tokens of one or more sequences, eager or from CUDA graphs
    decode_graphs.py  CUDA graphs for one-token decode (graph_pieces.py, captured_call.py, step_report.py)
    generate.py       prompt in, text out; prompt-state reuse around it
    prefix_cache.py   saved sequence states, found again by prefix (live, in host memory)
    stored_states.py  the saved states on disk (state_codec.py: a state as bytes)
    workload.py       a workload file through the engine, routing recorded (profile.py: profile, trace)
"""
