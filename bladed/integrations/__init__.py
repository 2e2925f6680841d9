"""bladed behind other inference engines: each module adapts one engine's own API to bladed's client (none is
imported by the rest of bladed, and each imports without its engine installed)."""
