"""The healthy-run corpus and the alarm benchmark (`stabkit alarms`): false alarms of every detector
on runs that are fine, planted spikes they must find, and lead times on the recipes' lost runs.

Harness code: it imports the library (`stabkit.attach`), never the reverse.
"""
