"""Files a bench run leaves: its JSON document and its figures (every workload's report uses these)."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(doc: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def save_figure(fig, path) -> None:
    """Lay out, write (creating the folder) and release a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
