"""The link between a drafter's device and a target server: the frames both ends speak (`protocol`) and the
engine's target side over it (`remote.RemoteTarget`), below the decoder that uses it and the server that answers."""
