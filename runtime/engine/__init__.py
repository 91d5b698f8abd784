"""The engine: how a step runs. Building an engine from a pack and an EngineConfig, the step (eager
or from CUDA graphs), the orchestration between the model and the expert store, and generation."""
