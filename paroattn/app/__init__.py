"""The application on top of the library: the `paro` command line, option checking, pipeline loading,
`paro generate`, `paro bench` and `paro demo`. The library (everything else in `paroattn`) never imports it."""
