"""`python -m flashpack.bench.demo_model [--quick] [--windows N|all] [--json F]`: the embedded demo
model measured through flashpack, on a CPU in FP32 (bench/results/demo-model-cpu.json and .md).
The folder is a module of the editable install's `flashpack` package (the repository root), so it
runs from anywhere with `-m`; it is not part of a wheel.

    held_out.py    the held-out windows, prompts and the unigram baseline, from the trainer's corpus
    sources.py     the model four ways: transformers on the snapshot (BF16 upcast) or on the
                   weights the pack holds; the engine on the NVFP4 pack or on the snapshot's weights
    loss.py        held-out loss, top-1 and the MTP head's agreement, window by window
    greedy.py      greedy tokens of transformers against the engine's, each divergence's margin
    edit_tasks.py  "rename this variable" prompts cut from held-out functions
    lookup.py      how often prompt lookup's draft (runtime/prompt_lookup.py) is what greedy decodes
    locality.py    routing locality per layer, traces recorded and replayed (flashpack trace)
    settings.py    what a run reads and decodes (the full run, and --quick for the test)
    measure.py     the five measurements, each returning its part of the JSON
    report.py      the tables printed and written beside the JSON
"""
