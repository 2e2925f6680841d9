"""The sessions wing: a session and its requests (``session``), the request rulebook every way in goes
through (``rules``), opening, binding and closing sessions (``manager``), admitting their staging memory
(``staging``), the daemon's one page-cache budget reading (``budget_reading``), and live re-planning: the
per-session demotion state (``live``) and the re-planner that turns a shrinking ``B_pc`` into demotions
(``replan``)."""
