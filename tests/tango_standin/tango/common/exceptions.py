class ConfigurationError(Exception):
    pass


class IntegrationMissingError(ImportError):
    pass
