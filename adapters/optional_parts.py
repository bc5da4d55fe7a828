"""An adapter's optional parts beside its PEFT files, as sources carry them: each a folder of two files
(a config, then weights) that a local directory, an archive, or an http(s)/s3 directory may hold.

- `medusa/`: its own Medusa heads (adapters.medusa_format);
- `draft/`: its draft LoRA, a PEFT adapter for the server's draft model (adapters.draft_lora).

Both files or neither: half a part is refused naming the missing file. The sources read them under the
same bounds as the PEFT files (the config's cap, the per-file cap); the store checks them against the
base (or draft) model as an upload's are.
"""
from __future__ import annotations

from dataclasses import dataclass

from adapters import draft_lora, medusa_format
from adapters.format import MAX_CONFIG_BYTES


@dataclass(frozen=True)
class OptionalPart:
    name: str  # the AdapterFiles field that carries it
    folder: str  # its folder beside the PEFT files
    files: tuple[str, str]  # (config, weights) names inside the folder
    config_cap: int  # the most bytes its config may have (the weights take the source's per-file cap)


OPTIONAL_PARTS = (
    OptionalPart("medusa", medusa_format.ADAPTER_DIR, (medusa_format.CONFIG_FILE, medusa_format.WEIGHTS_FILE),
                 medusa_format.MAX_CONFIG_BYTES),
    OptionalPart("draft", draft_lora.ADAPTER_DIR, draft_lora.FILES, MAX_CONFIG_BYTES),
)


def half_part(part: OptionalPart, missing: str) -> str:
    """The refusal of a part with one of its two files."""
    return f"the adapter's {part.folder}/ folder has no {missing}"
