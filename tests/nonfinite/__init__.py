"""Tests of stabkit.nonfinite: NaN/Inf decided on the device, localized by replay."""
