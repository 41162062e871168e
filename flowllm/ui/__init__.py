"""The web page at `/`: playground, live graph view, request timeline (docs/ui.md)."""
