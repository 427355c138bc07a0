"""Step time from the fake step: FLOPs and bytes per op (``count``), turned into seconds by a
roofline (``roofline``) with a GPU profile's figures or this CPU's measured ones (``cpu_profile``)."""
