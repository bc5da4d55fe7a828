"""Fairness under abuse: a victim tenant's latency while another tenant attacks (abuse, hostile-schema flood)."""
