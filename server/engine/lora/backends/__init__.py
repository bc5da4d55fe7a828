"""One class per multi-LoRA kernel strategy, behind LoraBackend (base.py); the engine picks one at
start-up (server.engine.kernel_choice), as SGLang's srt/lora/backend does."""
