"""The browser dashboard: routes.py serves it, the other files here are the page itself
(plain HTML, CSS and JavaScript modules, no build step, nothing fetched from elsewhere)."""
