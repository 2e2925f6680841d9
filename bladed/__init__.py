"""bladed: dual-path NVMe-direct KV-cache offloading daemon (Dual-Blade)."""

__version__ = "0.1.0"
