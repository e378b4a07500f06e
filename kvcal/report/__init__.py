"""Reports: plain-words disclosure (markdown/HTML) and plots. Drawing only, no computation."""
